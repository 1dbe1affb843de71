"""One collocated update cycle, in order, each phase timed:

pause gateway -> drain (bounded) -> sleep engine (GPU only) -> update -> save weights ->
wake engine + reload + reset prefix cache -> verify with a probe -> bump policy version ->
resume gateway.

Invariants:
- The gateway is resumed whatever happens after the pause (``finally``); its pause flag
  also expires on its own, so even a killed trainer cannot leave it paused.
- A step is trained at most once: its result is stored under ``run_step_result`` and a
  redelivered task returns it; each group is claimed for one step only (``group_trained``).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from app.config.loader import REPO_ROOT
from app.state import keys
from app.state.runs import run_config
from gateway.admission import Admission
from workers.trainer import checkpoint, weights
from workers.trainer.batch import collect_samples, to_batch
from workers.trainer.update import PolicyTrainer

log = logging.getLogger(__name__)

_resident: dict[str, Any] = {}


class StepError(RuntimeError):
    pass


def _path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def resident_trainer(run_id: str, cfg: Any) -> tuple[PolicyTrainer, dict]:
    """The model and optimizer stay in this process between steps of a run."""
    if _resident.get("run_id") != run_id:
        _resident.clear()
        trainer = PolicyTrainer(cfg, str(_path(cfg.actor_rollout_ref.model.path)))
        _resident.update(run_id=run_id, trainer=trainer, probe_prev=None)
        log.info("loaded policy for run %s on %s", run_id, trainer.device)
    return _resident["trainer"], _resident


def _claim_groups(client: redis.Redis, group_ids: list[str], step: int) -> list[str]:
    claimed = []
    for gid in group_ids:
        key = keys.group_trained(gid)
        if client.set(key, step, nx=True) or client.get(key) == str(step):
            claimed.append(gid)
        else:
            log.error("group %s was already trained at step %s; not training it again",
                      gid, client.get(key))
    return claimed


def _publish(client: redis.Redis, cfg: Any, trainer: PolicyTrainer, resident: dict,
             previous: list[float] | None, metrics: dict, timings: dict[str, float],
             wake: bool) -> int:
    """Save the trainer's weights as the next version, load them into every inference
    server, prove it with the probe, then bump the policy version; returns the version."""
    urls = list(cfg.inference.urls)
    version = int(client.get(keys.policy_version()) or 0) + 1
    t = time.monotonic()
    path = weights.save_weights(trainer.model, _path(cfg.trainer.weights_dir), version,
                                int(cfg.trainer.keep_weight_versions))
    timings["save"] = time.monotonic() - t

    t = time.monotonic()
    if wake:
        weights.wake_engine(urls, trainer.device)
    for url in urls:
        weights.reload_weights(url, path)
    timings["reload"] = time.monotonic() - t

    t = time.monotonic()
    expected = weights.trainer_probe_logprobs(
        trainer.model, weights.PROBE_IDS, weights.engine_dtype(cfg.inference.dtype))
    for url in urls:
        metrics.update(weights.verify_sync(url, cfg.inference.served_model_name, expected,
                                           previous, float(cfg.trainer.probe_tolerance)))
    resident["probe_prev"] = expected
    timings["probe"] = time.monotonic() - t
    client.set(keys.policy_version(), version)
    return version


def pause_during_update(cfg: Any, device: str) -> bool:
    """Whether the gateway stays paused for the whole update (``trainer.pause_during_update``).

    ``auto``: yes on CUDA, where the engine sleeps and lends its accelerator memory to the
    update; no on CPU, where nothing has to be freed, so rollouts keep going while the update
    runs and the pause covers only loading the new weights (the samples made meanwhile come
    from the previous version: their staleness is measured and corrected like any other)."""
    setting = cfg.trainer.pause_during_update
    if setting == "auto":
        return device.startswith("cuda")
    return bool(setting)


def train_step(client: redis.Redis, run_id: str, step: int) -> dict[str, Any]:
    done = client.get(keys.run_step_result(run_id, step))
    if done is not None:
        log.info("step %d of run %s already trained (redelivery); returning its metrics",
                 step, run_id)
        return json.loads(done)
    cfg = run_config(client, run_id)
    trainer, resident = resident_trainer(run_id, cfg)
    group_ids = _claim_groups(client, client.lrange(keys.run_step_groups(run_id, step), 0, -1),
                              step)
    zero = cfg.controller.on_failure == "zero_reward"
    samples, stats = collect_samples(client, group_ids, zero)
    if not samples:
        raise StepError(f"step {step}: no usable samples in {len(group_ids)} groups "
                        f"({stats.excluded_samples} excluded)")

    adm = Admission(client, float(cfg.gateway.lease_ttl_s))
    timings: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    urls = list(cfg.inference.urls)
    collocated = pause_during_update(cfg, trainer.device)

    def update() -> None:
        t = time.monotonic()
        if collocated:
            sleep_note = weights.sleep_engine(urls, trainer.device)
            if sleep_note.startswith("skipped") and not resident.get("sleep_logged"):
                log.info("engine sleep %s", sleep_note)
                resident["sleep_logged"] = True
        batch = to_batch(samples, trainer.pad_id, trainer.device)
        metrics.update(trainer.update(batch))
        timings["update"] = time.monotonic() - t

    if not collocated:
        update()  # rollouts go on meanwhile; the pause below covers only the weight load
    t0 = time.monotonic()
    inflight = adm.pause(pause_ttl_s=float(cfg.trainer.step_timeout_s))
    try:
        drained = adm.drain(float(cfg.gateway.drain_timeout_s))
        timings["pause_drain"] = time.monotonic() - t0
        metrics["training/async/proxy_inflight_at_pause"] = inflight
        metrics["training/async/proxy_drain_seconds"] = drained.seconds
        metrics["training/async/proxy_cancelled_at_drain_timeout"] = drained.cancelled
        if collocated:
            update()
        version = _publish(client, cfg, trainer, resident, resident["probe_prev"], metrics,
                           timings, wake=collocated)
    finally:
        t = time.monotonic()
        paused_for = adm.resume()
        timings["resume"] = time.monotonic() - t
    metrics["timing/gateway_paused_seconds"] = paused_for
    metrics.update({f"timing/trainer_{k}_seconds": v for k, v in timings.items()})
    rewards = stats.rewards
    metrics.update({
        "reward/mean": statistics.fmean(rewards) if rewards else None,
        "reward/max": max(rewards) if rewards else None,
        "reward/min": min(rewards) if rewards else None,
        "batch/groups": stats.groups,
        "batch/rollouts": stats.rollouts,
        "batch/samples": stats.samples,
        "batch/excluded_samples": stats.excluded_samples,
        "batch/failed_rollouts_zero_reward": stats.failed_rollouts_zero_reward,
        "policy/sample_version_lag_mean": statistics.fmean(
            [version - 1 - v for v in stats.versions]) if stats.versions else 0.0,
        "policy/version": version,
    })
    client.set(keys.run_step_result(run_id, step), json.dumps(metrics))
    done = step + 1
    if done % int(cfg.trainer.save_freq) == 0 or done >= int(cfg.trainer.total_steps):
        t = time.monotonic()
        checkpoint.save_checkpoint(trainer, _path(cfg.trainer.checkpoint_dir), run_id, done,
                                   version, client.hgetall(keys.run(run_id)))
        metrics["timing/trainer_checkpoint_seconds"] = time.monotonic() - t
    return metrics


def init_run(client: redis.Redis, run_id: str) -> dict[str, Any]:
    """Load the run's policy into this worker and make every inference server serve exactly
    it (a previous run may have left other weights there). Verified by the probe."""
    cfg = run_config(client, run_id)
    _resident.clear()
    trainer, resident = resident_trainer(run_id, cfg)
    resumed_from = checkpoint.latest_checkpoint(_path(cfg.trainer.checkpoint_dir), run_id)
    if resumed_from is not None:
        meta = checkpoint.load_checkpoint(trainer, resumed_from)
        log.info("run %s: resumed trainer state from %s (step %d)", run_id, resumed_from,
                 meta["step"])
    adm = Admission(client, float(cfg.gateway.lease_ttl_s))
    adm.pause(pause_ttl_s=float(cfg.trainer.step_timeout_s))
    try:
        adm.drain(float(cfg.gateway.drain_timeout_s))
        metrics: dict[str, Any] = {}
        version = _publish(client, cfg, trainer, resident, None, metrics, {}, wake=False)
    finally:
        adm.resume()
    metrics["policy/version"] = version
    metrics["resumed_from_step"] = meta["step"] if resumed_from is not None else None
    return metrics

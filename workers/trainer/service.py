"""One collocated update cycle, in order, each phase timed:

pause gateway -> drain (bounded) -> sleep engine (GPU only) -> update -> save weights ->
wake engine + reload + reset prefix cache -> bump policy version -> verify with a probe ->
resume gateway.

``gateway.drain_mode`` keep or abort replaces the drain: the engines pause their generation
(keep freezes the calls in flight, abort ends them), and resume right after the version bump,
before the probe (which needs them running).

Invariants:
- The gateway is resumed whatever happens after the pause (``finally``); the pause is also a
  lease the trainer keeps extending (``liveness.Beats``), so a SIGKILLed trainer leaves the
  gateway paused for at most ``trainer.heartbeat_s``.
- A step is trained at most once: its result is stored under ``run_step_result`` and a
  redelivered task returns it; each group is claimed for one step only (``group_trained``).
- A trainer process that takes up a run it did not start (the previous worker died) restores
  the run's last checkpoint and loads those weights into every inference server before it
  trains: the servers, the trainer and the policy version agree again.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import requests

from app.config.loader import REPO_ROOT
from app.services.commands import sleep_mode
from app.services.device import resolve as resolve_device
from app.state import keys, retention
from app.state.cached_reads import POLICY_VERSION_MAX_AGE_S
from app.state.runs import run_config
from gateway.admission import Admission
from workers.trainer import checkpoint, weights
from workers.trainer.batch import collect_samples
from workers.trainer.engine import EngineTrainer
from workers.trainer.keeper import publish_lock, running_keeper
from workers.trainer.liveness import Beats
from workers.trainer.verl_batch import to_verl_batch

log = logging.getLogger(__name__)

_resident: dict[str, Any] = {}


class StepError(RuntimeError):
    pass


def _path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def resident_trainer(run_id: str, cfg: Any) -> tuple[EngineTrainer, dict]:
    """The model and optimizer stay in this process between steps of a run. Loaded from the
    run's last checkpoint when it has one (a resumed run, or a restarted worker)."""
    if _resident.get("run_id") != run_id:
        if "trainer" in _resident:
            _resident["trainer"].close()
        _resident.clear()
        model_path = str(_path(cfg.actor_rollout_ref.model.path))
        trainer = EngineTrainer(cfg, model_path)
        _resident.update(run_id=run_id, trainer=trainer, probe_prev=None, restored_step=None,
                         published=False, probe_ids=weights.probe_ids(model_path))
        log.info("loaded policy for run %s on %s", run_id, trainer.device)
        latest = checkpoint.latest_checkpoint(_path(cfg.trainer.checkpoint_dir), run_id)
        if latest is not None:
            meta = checkpoint.load_checkpoint(trainer, latest)
            _resident["restored_step"] = meta["step"]
            log.info("run %s: restored trainer state from %s (step %d)", run_id, latest,
                     meta["step"])
        keeper = running_keeper()
        if keeper is not None:
            keeper.configure(list(cfg.inference.urls), cfg.inference.served_model_name,
                             float(cfg.trainer.probe_tolerance))
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


def _publish(client: redis.Redis, cfg: Any, trainer: EngineTrainer, resident: dict,
             previous: list[float] | None, metrics: dict, timings: dict[str, float],
             wake: bool, held: list[str] | None = None, frozen: bool = False) -> int:
    """Save the trainer's weights as the next version, load them into every inference
    server, bump the policy version, resume the engines in ``held`` (paused by
    ``gateway.drain_mode`` keep or abort; ``frozen``: calls wait frozen in them), then prove
    the load with the probe; returns the version.

    A probe that fails leaves the version bumped: the servers do hold that version's
    weights, only not verified ones, and the step fails."""
    urls = list(cfg.inference.urls)
    version = int(client.get(keys.policy_version()) or 0) + 1
    t = time.monotonic()
    model_path = _path(cfg.actor_rollout_ref.model.path)
    dtype = str(weights.engine_dtype(cfg.inference.dtype, model_path)).replace("torch.", "")
    path = weights.publish_version(
        _path(cfg.trainer.weights_dir), version, int(cfg.trainer.keep_weight_versions),
        lambda tmp: trainer.export_weights(tmp, dtype))
    timings["save"] = time.monotonic() - t

    t = time.monotonic()
    if wake:
        weights.wake_engines(urls)
    loaded = switch_weights(client, urls, path, version, held or [], frozen,
                            float(cfg.trainer.reload_timeout_s),
                            float(cfg.trainer.upstream_check_s))
    timings["reload"] = time.monotonic() - t

    t = time.monotonic()
    ids = resident["probe_ids"]
    expected = trainer.probe_log_probs(ids)
    for url in loaded:
        metrics.update(weights.verify_sync(url, cfg.inference.served_model_name, expected,
                                           previous, float(cfg.trainer.probe_tolerance), ids))
    client.srem(keys.upstreams_stale(), *[u.rstrip("/") for u in loaded])
    resident["probe_prev"] = expected
    resident["published"] = True
    timings["probe"] = time.monotonic() - t
    client.hset(keys.policy_published(), mapping={
        "version": version, "path": str(path.resolve()), "probe": json.dumps(expected),
        "probe_ids": json.dumps(ids)})
    return version


def switch_weights(client: redis.Redis, urls: list[str], path: Path, version: int,
                   held: list[str], frozen: bool, wait_s: float, every_s: float) -> list[str]:
    """Load ``path`` into every reachable server, make ``version`` the policy version, then
    resume the engines in ``held`` (emptied). Returns the servers loaded.

    The version is set while the engines are still paused, and they resume twice
    ``POLICY_VERSION_MAX_AGE_S`` later: every gateway process then reads the new version by
    the first token a frozen call samples on the new weights, and places the switch there."""
    loaded = _reload_reachable(client, urls, path, version, wait_s, every_s, frozen)
    client.set(keys.policy_version(), version)
    if held:
        time.sleep(2 * POLICY_VERSION_MAX_AGE_S)
        weights.resume_engines(held)
        held.clear()
    return loaded


def _reload_reachable(client: redis.Redis, urls: list[str], path: Path, version: int,
                      wait_s: float, every_s: float, frozen: bool = False) -> list[str]:
    """Load ``path`` into every server that answers; returns those. A server that is down
    is marked stale (the upstream keeper loads it when it is back, the gateway routes around
    it meanwhile). With none reachable, keep trying for ``wait_s`` (the gateway stays
    paused: a restarted server must hold the current weights before agents reach it)."""
    deadline = time.monotonic() + wait_s
    errors: dict[str, str] = {}
    while True:
        loaded = []
        for url in urls:
            try:
                weights.reload_weights(url, path, frozen_calls=frozen)
                loaded.append(url)
            except requests.ConnectionError as exc:
                client.sadd(keys.upstreams_stale(), url.rstrip("/"))
                if url not in errors:
                    log.warning("inference server %s is unreachable; it gets version %d when "
                                "it is back", url, version)
                errors[url] = f"{exc.__class__.__name__}: {exc}"
        if loaded:
            return loaded
        if time.monotonic() >= deadline:
            raise weights.WeightSyncError(
                f"no inference server could be reached to load version {version} within "
                f"{wait_s:.0f} s (Connection refused or lost): "
                + "; ".join(f"{u} ({e})" for u, e in errors.items()))
        time.sleep(every_s)


@contextmanager
def _paused(adm: Admission, cfg: Any, beats: Beats, out: dict[str, float]) -> Iterator[int]:
    """Pause the gateway as a lease kept alive by ``beats``; always resume. Yields the
    requests in flight at the pause; ``out["paused_for"]`` is set on the way out. Holds the
    publish lock so the upstream keeper never reloads a server in between."""
    ttl = float(cfg.trainer.heartbeat_s)
    with publish_lock:
        inflight = adm.pause(pause_ttl_s=ttl)

        def extend() -> None:
            if not adm.extend_pause(ttl):
                log.error("the gateway pause could not be extended (it expired or was taken "
                          "over): this step will not touch the weights")

        beats.add("pause", extend)
        try:
            yield inflight
        finally:
            beats.remove("pause")
            t = time.monotonic()
            out["paused_for"] = adm.resume()
            out["resume"] = time.monotonic() - t


def require_pause(adm: Admission, what: str) -> None:
    """Abort the step, before ``what`` touches any weight, when the pause is no longer ours
    (its lease could not be extended, or it expired and another holder took it over):
    agents may be generating, and a reload under them trains on garbage."""
    if not adm.holds_pause():
        raise StepError(f"the gateway pause was lost before {what}; the step is aborted "
                        "with no weight changed (trainer.heartbeat_s may be too short for "
                        "this machine)")


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
    with Beats(client, keys.trainer_heartbeat(run_id, str(step)),
               float(cfg.trainer.heartbeat_s)) as beats:
        return _train_step(client, run_id, step, cfg, beats)


def _serve_resident(client: redis.Redis, cfg: Any, trainer: EngineTrainer, resident: dict,
                    beats: Beats, metrics: dict[str, Any]) -> int:
    """Make every inference server serve the resident weights as they are (no update):
    pause, drain, publish, resume. Returns the new policy version."""
    adm = Admission(client, float(cfg.gateway.lease_ttl_s))
    with _paused(adm, cfg, beats, {}):
        adm.drain(float(cfg.gateway.drain_timeout_s))
        require_pause(adm, "loading the weights")
        return _publish(client, cfg, trainer, resident, None, metrics, {}, wake=False)


def _restore_servers(client: redis.Redis, cfg: Any, trainer: EngineTrainer, resident: dict,
                     beats: Beats, step: int) -> dict[str, Any]:
    """This process took up a run mid-way (its previous trainer worker died): bring every
    inference server back to the weights it restored before training on."""
    log.warning("trainer worker took up run %s at step %d: restored from the checkpoint of "
                "step %s; loading those weights into the inference servers", resident["run_id"],
                step, resident["restored_step"])
    version = _serve_resident(client, cfg, trainer, resident, beats, {})
    return {"trainer/restored_from_step": resident["restored_step"],
            "trainer/restored_policy_version": version}


def _drain(adm: Admission, cfg: Any, metrics: dict[str, Any]) -> None:
    """``gateway.drain_mode: wait``: wait for the calls in flight (bounded), cancel the rest."""
    drained = adm.drain(float(cfg.gateway.drain_timeout_s))
    metrics["training/async/proxy_drain_seconds"] = drained.seconds
    metrics["training/async/proxy_cancelled_at_drain_timeout"] = drained.cancelled
    if drained.unended:
        raise StepError(f"{drained.unended} request(s) cancelled at the drain timeout were "
                        "still generating after a lease TTL; not loading weights under them")


def hold_engines(adm: Admission, urls: list[str], mode: str, metrics: dict[str, Any]
                 ) -> list[str]:
    """``gateway.drain_mode`` keep or abort: pause generation inside the engines instead of
    waiting for the calls in flight. keep freezes them (they finish on the new weights);
    abort cancels their leases first (their agents get a retryable error, nothing of them
    is recorded), then ends them in the engines. -> the servers paused."""
    t = time.monotonic()
    cancelled = adm.cancel_live() if mode == "abort" else []
    frozen = adm.live_leases() if mode == "keep" else 0
    try:
        held = weights.pause_engines(urls, mode)
    except weights.EnginePauseError as exc:
        raise StepError(str(exc)) from exc
    unended = adm.wait_ended(cancelled, adm.ttl_ms / 1000.0) if cancelled else 0
    metrics["training/async/proxy_drain_seconds"] = time.monotonic() - t
    metrics["training/async/proxy_frozen_calls"] = frozen
    metrics["training/async/proxy_aborted_calls"] = len(cancelled)
    if unended:
        weights.resume_engines(held, check=False)
        raise StepError(f"{unended} aborted request(s) were still live after a lease TTL; "
                        "not loading weights under them")
    return held


def _train_step(client: redis.Redis, run_id: str, step: int, cfg: Any, beats: Beats
                ) -> dict[str, Any]:
    trainer, resident = resident_trainer(run_id, cfg)
    metrics: dict[str, Any] = {}
    if not resident["published"]:
        metrics.update(_restore_servers(client, cfg, trainer, resident, beats, step))
    group_ids = _claim_groups(client, client.lrange(keys.run_step_groups(run_id, step), 0, -1),
                              step)
    zero = cfg.controller.on_failure == "zero_reward"
    samples, stats = collect_samples(client, group_ids, zero)
    if not samples:
        raise StepError(f"step {step}: no usable samples in {len(group_ids)} groups "
                        f"({stats.excluded_samples} excluded)")

    adm = Admission(client, float(cfg.gateway.lease_ttl_s))
    timings: dict[str, float] = {}
    urls = list(cfg.inference.urls)
    collocated = pause_during_update(cfg, trainer.device)
    # The engines sleep through a collocated update where sleep mode is on (GPU): checked,
    # and woken again whatever happens to the update.
    sleeping = collocated and sleep_mode(cfg, resolve_device(str(cfg.inference.device)))

    engines = {"asleep": False}

    def update() -> None:
        t = time.monotonic()
        if sleeping:
            try:
                weights.sleep_engines(urls, int(cfg.inference.sleep_level))
            except weights.EngineSleepError as exc:
                raise StepError(f"step {step} not trained: {exc}") from exc
            engines["asleep"] = True
        metrics.update(trainer.update(to_verl_batch(samples, trainer.pad_id), step))
        timings["update"] = time.monotonic() - t

    if not collocated:
        update()  # rollouts go on meanwhile; the pause below covers only the weight load
    t0 = time.monotonic()
    out: dict[str, float] = {}
    mode = str(cfg.gateway.drain_mode)
    held: list[str] = []   # engines paused (drain_mode keep or abort) until the new weights
    with _paused(adm, cfg, beats, out) as inflight:
        try:
            metrics["training/async/proxy_inflight_at_pause"] = inflight
            if mode == "wait":
                _drain(adm, cfg, metrics)
            else:
                held.extend(hold_engines(adm, urls, mode, metrics))
            timings["pause_drain"] = time.monotonic() - t0
            if collocated:
                require_pause(adm, "the update")
                update()
            require_pause(adm, "loading the new weights")
            version = _publish(client, cfg, trainer, resident, resident["probe_prev"],
                               metrics, timings, wake=engines["asleep"], held=held,
                               frozen=mode == "keep")
            engines["asleep"] = False
        finally:
            if engines["asleep"]:  # a failure between sleep and reload: agents need them
                weights.wake_engines(urls, check=False)
            if held:  # a failure before the engines resumed: frozen calls must go on
                weights.resume_engines(held, check=False)
    timings["resume"] = out["resume"]
    metrics["timing/gateway_paused_seconds"] = out["paused_for"]
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
        "batch/mixed_version_samples": stats.mixed_version_samples,
        "batch/mixed_version_tokens": stats.mixed_version_tokens,
        "policy/sample_version_lag_mean": statistics.fmean(
            [version - 1 - v for v in stats.versions]) if stats.versions else 0.0,
        "policy/version": version,
    })
    client.set(keys.run_step_result(run_id, step), json.dumps(metrics))
    # a redelivery returns the stored result: what the groups captured is not read again
    retention.release_trained(client, group_ids, float(cfg.trainer.trained_data_ttl_s))
    done = step + 1
    if done % int(cfg.trainer.save_freq) == 0 or done >= int(cfg.trainer.total_steps):
        t = time.monotonic()
        checkpoint.save_checkpoint(trainer, _path(cfg.trainer.checkpoint_dir), run_id, done,
                                   version, client.hgetall(keys.run(run_id)))
        metrics["timing/trainer_checkpoint_seconds"] = time.monotonic() - t
    return metrics


def init_run(client: redis.Redis, run_id: str) -> dict[str, Any]:
    """Load the run's policy into this worker (from its last checkpoint, if any) and make
    every inference server serve exactly it (a previous run may have left other weights
    there). Verified by the probe."""
    cfg = run_config(client, run_id)
    _resident.clear()
    trainer, resident = resident_trainer(run_id, cfg)
    metrics: dict[str, Any] = {}
    with Beats(client, keys.trainer_heartbeat(run_id, "init"),
               float(cfg.trainer.heartbeat_s)) as beats:
        version = _serve_resident(client, cfg, trainer, resident, beats, metrics)
    metrics["policy/version"] = version
    metrics["resumed_from_step"] = resident["restored_step"]
    return metrics

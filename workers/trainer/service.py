"""One update cycle, read top to bottom in ``_train_step``, each phase timed:

claim the step's groups -> pause the gateway -> drain -> update (with the engines asleep on
GPU) -> publish (save, reload every server, bump the policy version) -> verify with a probe
-> resume the gateway.

Where the update runs outside the pause (``trainer.pause_during_update`` false, or auto on
CPU) it comes right after the claim and rollouts go on meanwhile. ``gateway.drain_mode``
picks the drain (``drain.py``); keep and abort hold the engines paused, and they resume
right after the version bump, before the probe (which needs them running).

Invariants:
- The gateway is resumed whatever happens after the pause (``finally``); the pause is also a
  lease the trainer keeps extending (``liveness.Beats``), so a SIGKILLed trainer leaves the
  gateway paused for at most ``trainer.heartbeat_s``.
- An engine paused or put to sleep by a step is resumed or woken whatever happens after
  (``weights.Held`` as a context manager).
- A step is trained at most once: its result is stored under ``run_step_result`` and a
  redelivered task returns it; each group is claimed for one step only (``group_trained``).
- A trainer process that takes up a run it did not start (the previous worker died) restores
  the run's last checkpoint and loads those weights into every inference server before it
  trains: the servers, the trainer and the policy version agree again.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis
import requests

from app.config.secrets import inference_api_key
from app.config.settings import adapter_name
from app.state import keys, retention
from app.state.cached_reads import POLICY_VERSION_MAX_AGE_S
from app.state.pause import Pause
from app.state.policy import current_version, published_here
from app.state.runs import read_run, run_config
from workers.trainer import checkpoint, weights
from workers.trainer.batch import BatchStats, Sample, collect_samples
from workers.trainer.drain import drain_for
from workers.trainer.engine import EngineTrainer
from workers.trainer.errors import StepError
from workers.trainer.keeper import left_held, publish_lock, running_keeper
from workers.trainer.liveness import Beats
from workers.trainer.settings import TrainerSettings
from workers.trainer.verl_batch import to_verl_batch

__all__ = ["Resident", "StepError", "init_run", "publish", "require_pause",
           "restore_servers", "switch_weights", "train_step"]

log = logging.getLogger(__name__)

Metrics = dict[str, Any]


@dataclass
class Resident:
    """The run this process trains: model and optimizer stay between its steps."""

    run_id: str
    trainer: EngineTrainer
    probe_ids: list[int]
    probe_prev: list[float] | None = None  # the probe of the weights the servers hold
    restored_step: int | None = None       # the checkpoint this process started from
    steps_done: int = 0                    # the run's updates its weights hold
    # an update ran that no recorded step holds (its step failed after it): these weights
    # are not the run's, and a retry of the step must not train on top of them
    unrecorded: bool = False
    # the step whose whole update those weights hold (it failed later: the load, the
    # probe): a retry of that step publishes them and records it, without training its
    # groups again or throwing away the updates since the last checkpoint
    updated_step: int | None = None
    update_metrics: Metrics = field(default_factory=dict)  # what that update reported
    published: bool = False                # the servers hold this process's weights
    saves: checkpoint.BackgroundSaves = field(default_factory=checkpoint.BackgroundSaves)
    export_root: Path | None = None        # where this process's exports go (decided once)
    # the policy version the trainer's weights are (None from an update until its publish):
    # what the upstream keeper may send a restarted server by weight transfer
    weights_version: int | None = None
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # per server, last load
    # the rollback of a take-over made outside a step (restore_servers): the next step's
    # metrics report it, so the driver's warning names the updates lost
    rollback: Metrics = field(default_factory=dict)
    # which trainer this is in this process (each one built gets the next number): a step
    # remembered as trained by another (an earlier one, replaced since) is not in these
    # weights
    generation: int = 0

    def close(self) -> None:
        """Finish a checkpoint still being written, then free the engine and the exports
        this process kept in shared memory (host memory, not disk: the checkpoints hold
        the weights)."""
        try:
            self.saves.close()
        except checkpoint.CheckpointError as exc:
            log.error("%s", exc)
        try:
            self.trainer.close()
        finally:
            if self.export_root is not None and weights.in_shared_memory(self.export_root):
                shutil.rmtree(self.export_root, ignore_errors=True)


_resident: Resident | None = None
_generations = itertools.count(1)


def resident_generation(run_id: str) -> int | None:
    """The generation of this process's trainer when it is ``run_id``'s, else None."""
    return _resident.generation if _resident is not None and _resident.run_id == run_id \
        else None


def close_resident() -> None:
    global _resident
    keeper = running_keeper()
    if keeper is not None:
        keeper.send_weights = None  # it would send from a closed trainer
    if _resident is not None:
        _resident.close()
    _resident = None


def resident_trainer(run_id: str, cfg: Any, settings: TrainerSettings,
                     step: int | None = None, recorded: int | None = None) -> Resident:
    """The run's resident trainer, loaded from the run's last checkpoint when it has one (a
    resumed run, or a restarted worker). ``step``: the step about to be trained (None: the
    next one to record). ``recorded``: the updates the run has recorded; a checkpoint
    holding more (written after a step whose record a Redis crash then lost) is passed
    over, else the step it holds would be trained a second time on top of it."""
    global _resident
    if _resident is not None and _resident.run_id == run_id:
        if not _resident.unrecorded or _resident.updated_step == (
                _resident.steps_done if step is None else step):
            return _resident
        log.warning("run %s: an earlier attempt updated this trainer's weights and failed "
                    "before its step was recorded; reloading the last checkpoint instead of "
                    "training on top of that update", run_id)
    close_resident()
    trainer = EngineTrainer(cfg, str(settings.model_path))
    log.info("loaded policy for run %s on %s", run_id, trainer.device)
    moved = [] if recorded is None else \
        checkpoint.set_aside_after(settings.checkpoint_dir, run_id, recorded)
    latest = checkpoint.latest_checkpoint(settings.checkpoint_dir, run_id)
    if moved:
        log.warning("run %s: checkpoints hold more updates than the %d the run recorded (a "
                    "Redis crash lost the latest records): restoring %s instead, so no step "
                    "is trained twice; set aside: %s", run_id, recorded,
                    latest if latest is not None else "the initial weights",
                    ", ".join(p.name for p in moved))
    meta = None
    candidates = checkpoint.complete_checkpoints(settings.checkpoint_dir, run_id)
    for i, path in enumerate(candidates):
        try:
            meta = checkpoint.load_checkpoint(trainer, path)
        except Exception as exc:
            # Only a checkpoint whose files are torn, and only the newest (a power loss
            # during its save), gives way to the one before. Anything else (no memory, a
            # rank lost, a file system away) fails the task as before: retried, it may load.
            if i > 0 or not checkpoint.is_torn(exc):
                raise
            aside = checkpoint.set_aside(path, "unreadable")
            log.error("run %s: checkpoint %s is torn (%s: %s); set aside as %s, loading the "
                      "one before", run_id, path.name, exc.__class__.__name__, exc, aside.name)
            trainer.close()  # a load that failed half-way may have changed its state
            trainer = EngineTrainer(cfg, str(settings.model_path))
            continue
        log.info("run %s: restored trainer state from %s (step %d)", run_id, path,
                 meta["step"])
        break
    resident = Resident(run_id, trainer, weights.probe_ids(settings.model_path),
                        generation=next(_generations))
    if meta is not None:
        resident.restored_step = resident.steps_done = meta["step"]
    keeper = running_keeper()
    if keeper is not None:
        inf = settings.inference
        keeper.configure(list(inf.urls), inf.served_model_name, settings.probe_tolerance,
                         settings.reload_timeout_s, inf.data_parallel_size, inf.sleep_mode,
                         settings.upstream_check_s)
        keeper.send_weights = partial(send_again, resident, settings) \
            if inf.weight_sync == "transfer" else None
    _resident = resident
    return resident


def train_step(client: redis.Redis, run_id: str, step: int) -> Metrics:
    done = client.get(keys.run_step_result(run_id, step))
    if done is not None:
        log.info("step %d of run %s already trained (redelivery); returning its metrics",
                 step, run_id)
        # the worker that stored it may have died before releasing what the groups captured
        # (idempotent: what was released is gone, the rest gets its TTL again)
        groups = client.lrange(keys.run_step_groups(run_id, step), 0, -1)
        if groups:
            keep_s = float(run_config(client, run_id).trainer.trained_data_ttl_s)
            retention.release_trained(client, groups, keep_s)
        return dict(json.loads(done))
    cfg, settings = _task_start(client, run_id)
    with Beats(client, keys.trainer_heartbeat(run_id, str(step)), settings.heartbeat_s) as beats:
        take_back_orphans(client, settings)
        return _train_step(client, run_id, step, cfg, settings, beats)


def recorded_steps(client: redis.Redis, run_id: str, step: int) -> int:
    """The updates run ``run_id`` has recorded, ``step`` being the driver's step counter: a
    driver that died between a step's record and its counter's increment is one behind."""
    while client.exists(keys.run_step_result(run_id, step)):
        step += 1
    return step


def _task_start(client: redis.Redis, run_id: str) -> tuple[Any, TrainerSettings]:
    """What every trainer task does first: the run's config and settings, and the servers'
    key. Then, inside the task's heartbeat (a wake can take minutes), it takes back the
    engines a dead trainer left paused or asleep (:func:`take_back_orphans`)."""
    cfg = run_config(client, run_id)
    settings = TrainerSettings.from_config(cfg)
    weights.use_api_key(inference_api_key(cfg))
    return cfg, settings


def take_back_orphans(client: redis.Redis, settings: TrainerSettings) -> list[str]:
    """Take back the engines a dead trainer left paused or asleep (SIGKILL, OOM or an NCCL
    fault between pausing them and resuming them skips its ``finally``), unless a live pause
    holds them (its step takes them back itself). -> those found. Each one is stale until
    the upstream keeper has reloaded it (the dead trainer may have been mid-load; asleep,
    an engine may have dropped its weights, sleep level 2): one asleep is woken now
    (vLLM can crash serving a request asleep), one paused stays paused until reloaded."""
    inf = settings.inference
    found = {u: left_held(client, u, inf.sleep_mode) for u in inf.urls}
    for url, left in found.items():
        if not left:
            continue
        asleep = "sleeping" in left
        if asleep:
            weights.wake_if_asleep(url, settings.reload_timeout_s)
        log.warning("inference server %s was %s with no pause held (a trainer died "
                    "mid-update): stale until the upstream keeper has reloaded it", url,
                    "asleep (woken)" if asleep else "paused")
        client.sadd(keys.upstreams_stale(), url.rstrip("/"))
    return [u for u, left in found.items() if left]


def _train_step(client: redis.Redis, run_id: str, step: int, cfg: Any,
                settings: TrainerSettings, beats: Beats) -> Metrics:
    resident = resident_trainer(run_id, cfg, settings, step, recorded=step)
    metrics: Metrics = {}
    timings: dict[str, float] = {}
    # this step's update already ran here and only its publish failed: publish it again
    redo = resident.unrecorded and resident.updated_step == step
    if redo:
        log.warning("step %d of run %s: its update is already in this trainer's weights (the "
                    "step failed after it); publishing it again, its groups not trained again",
                    step, run_id)
        metrics.update(resident.update_metrics)
        # one such try: should the publish fail again (weights it cannot load, say), the
        # next attempt reloads the last checkpoint instead of trying them for ever
        resident.updated_step = None
    if resident.saves.pending:
        # the previous step's checkpoint, written while this step's groups were collected
        metrics["timing/trainer_wait_for_checkpoint_seconds"] = resident.saves.wait()
        metrics["timing/trainer_background_checkpoint_seconds"] = resident.saves.last_write_s
    if not resident.published and not redo:
        metrics.update(_restore_servers(client, settings, resident, beats, step))
    metrics.update(resident.rollback)
    group_ids, samples, stats = claim(client, run_id, step, settings)
    collocated = settings.collocated(resident.trainer.device)
    if not collocated and not redo:
        update(resident, samples, stats, step, metrics, timings)  # rollouts go on meanwhile
    pause = Pause(client, settings.lease_ttl_s)
    t = time.monotonic()
    with paused(pause, settings, beats, timings) as inflight, ExitStack() as undo:
        metrics["training/async/proxy_inflight_at_pause"] = inflight
        held = undo.enter_context(drain_for(settings).quiet(pause, metrics))
        timings["pause_drain"] = time.monotonic() - t
        asleep = weights.NOTHING_HELD
        if collocated:
            require_pause(pause, "the update")
            t = time.monotonic()
            if settings.sleeps(resident.trainer.device):
                # also for a redo: the publish then hands the memory over as after an
                # update (the trainer's state offloaded before the engines' KV cache wakes)
                asleep = undo.enter_context(sleep_engines(settings, step))
                # on a failure before the load completed, the engines are woken (by the
                # context) on weights that may be gone (sleep level 2): stale until reloaded
                undo.callback(_stale, client, asleep)
            if not redo:
                update(resident, samples, stats, step, metrics, timings)
            timings["update"] = time.monotonic() - t  # the engines' sleep included
        require_pause(pause, "loading the new weights")
        published = publish(client, settings, resident, timings, metrics, asleep, held)
        verify(client, settings, resident, published, resident.probe_prev, metrics, timings)
    version = published.version
    metrics.update(step_metrics(stats, version, timings))
    record(client, run_id, step, group_ids, metrics, settings)
    resident.unrecorded, resident.steps_done, resident.rollback = False, step + 1, {}
    resident.updated_step, resident.update_metrics = None, {}
    save_if_due(client, settings, resident, run_id, step, version, metrics)
    return metrics


# --- the phases, in order -------------------------------------------------------------

def claim(client: redis.Redis, run_id: str, step: int, settings: TrainerSettings
          ) -> tuple[list[str], list[Sample], BatchStats]:
    """The step's groups, each claimed for this step only, and their samples."""
    group_ids = _claim_groups(client, client.lrange(keys.run_step_groups(run_id, step), 0, -1),
                              step)
    samples, stats = collect_samples(client, group_ids, settings.zero_reward_failures,
                                     settings.min_group_rewards, settings.overlong)
    if not samples and not stats.rollouts:
        raise StepError(f"step {step}: no rollouts in {len(group_ids)} groups")
    return group_ids, samples, stats


def _claim_groups(client: redis.Redis, group_ids: list[str], step: int) -> list[str]:
    claimed = []
    for gid in group_ids:
        key = keys.group_trained(gid)
        if client.set(key, step, nx=True, ex=retention.GUARD_TTL_S) \
                or client.get(key) == str(step):
            claimed.append(gid)
        else:
            log.error("group %s was already trained at step %s; not training it again",
                      gid, client.get(key))
    return claimed


@contextmanager
def paused(pause: Pause, settings: TrainerSettings, beats: Beats, timings: dict[str, float]
           ) -> Iterator[int]:
    """Pause the gateway as a lease kept alive by ``beats``; always resume. Yields the
    requests in flight at the pause; ``timings`` gets ``paused_for`` and ``resume`` on the
    way out. Holds the publish lock so the upstream keeper never reloads a server in
    between."""
    ttl = settings.heartbeat_s
    with publish_lock:
        inflight = pause.pause(pause_ttl_s=ttl)

        def extend() -> None:
            if not pause.extend_pause(ttl):
                log.error("the gateway pause could not be extended (it expired or was taken "
                          "over): this step will not touch the weights")

        beats.add("pause", extend)
        try:
            yield inflight
        finally:
            beats.remove("pause")
            t = time.monotonic()
            timings["paused_for"] = pause.resume()
            timings["resume"] = time.monotonic() - t


def require_pause(pause: Pause, what: str) -> None:
    """Abort the step, before ``what`` touches any weight, when the pause is no longer ours
    (its lease could not be extended, or it expired and another holder took it over):
    agents may be generating, and a reload under them trains on garbage."""
    if not pause.holds_pause():
        raise StepError(f"the gateway pause was lost before {what}; the step is aborted "
                        "with no weight changed (trainer.heartbeat_s may be too short for "
                        "this machine)")


def sleep_engines(settings: TrainerSettings, step: int) -> weights.Held:
    """The engines asleep, their accelerator memory lent to the update (checked)."""
    inf = settings.inference
    try:
        # the memory moves of the model's size, as a load does: the load's timeout
        return weights.sleep_engines(list(inf.urls), inf.sleep_level,
                                     settings.reload_timeout_s)
    except weights.EngineSleepError as exc:
        raise StepError(f"step {step} not trained: {exc}") from exc


def _stale(client: redis.Redis, asleep: weights.Held) -> None:
    if asleep.urls:
        client.sadd(keys.upstreams_stale(), *asleep.urls)
        log.warning("the step failed with %s asleep: woken, and stale until the upstream "
                    "keeper has loaded the current weights", ", ".join(asleep.urls))


def update(resident: Resident, samples: list[Sample], stats: BatchStats, step: int,
           metrics: Metrics, timings: dict[str, float]) -> None:
    t = time.monotonic()
    trainer = resident.trainer
    resident.weights_version = None
    resident.unrecorded = True  # until the step is recorded
    resident.updated_step = None  # until the update has run to its end
    if not samples:
        # Nothing to train on: every call cut at max_tokens and masked out, excluded, or no
        # call made (rollouts that failed before their first, scored 0). The step goes
        # through empty: failing it would fail it again at every --resume, for ever.
        log.warning("step %d trains nothing: of %d rollouts, %d left no trainable call "
                    "(%d calls excluded, %d masked as over-long, %d groups with too few "
                    "rewards)", step, stats.rollouts, len(stats.rowless),
                    stats.excluded_samples, stats.overlong_masked_calls, stats.small_groups)
        metrics.update({"batch/trained_tokens": 0.0, "batch/rows": 0.0})
    else:
        metrics.update(trainer.update(to_verl_batch(samples, trainer.pad_id, stats.rowless),
                                      step))
    resident.updated_step = step
    resident.update_metrics = dict(metrics)
    timings["update"] = time.monotonic() - t


@dataclass(frozen=True)
class Published:
    version: int
    path: Path | None   # the export (None: sent by weight transfer)
    loaded: list[str]   # the servers that hold it


def publish(client: redis.Redis, settings: TrainerSettings, resident: Resident,
            timings: dict[str, float], metrics: Metrics,
            asleep: weights.Held = weights.NOTHING_HELD,
            held: weights.Held = weights.NOTHING_HELD, fresh_base: bool = False) -> Published:
    """Save the trainer's weights as the next version, load them into every reachable
    server, bump the policy version and resume the engines in ``held``.

    Engines in ``asleep`` (a collocated update) get their memory back in the order of verl's
    colocated weight update: the export (the engines still asleep), the trainer empties its
    allocator's cache, each engine wakes its weights only, the load, the trainer parks what
    ``fsdp_config`` offloads and empties the cache again on every rank (the call returns when
    all have: a barrier), and only then the engines wake their KV cache. Each rank's memory
    at each of these points is a metric (``memory/trainer_rank<r>_<stage>_*``)."""
    inf = settings.inference
    trainer = resident.trainer
    if asleep.urls:
        metrics.update(trainer.memory("after_update"))
    version = current_version(client) + 1
    # the export and the load of each mode (LoRA's adapter goes by disk, never by transfer:
    # the config refuses the pair)
    load: Loader
    path = export(settings, resident, version, timings,
                  client.hget(keys.policy_published(), "path") or None) \
        if inf.lora or inf.weight_sync == "disk" else None
    if inf.lora and path is not None:
        load = adapter_loader(path, settings, version, held.frozen_calls, metrics, fresh_base)
    elif path is not None:
        load = disk_loader(path, version, settings.reload_timeout_s, held.frozen_calls)
    else:
        load = transfer_loader(resident, settings, version, held.frozen_calls, metrics)

    t = time.monotonic()
    if asleep.urls:
        metrics.update(trainer.release_memory("before_weights_wake", offload=False))
        asleep.wake(["weights"])

    def wake_kv_cache() -> None:
        if asleep.urls:
            metrics.update(trainer.release_memory("before_kv_cache_wake", offload=True))
            asleep.release(tags=["kv_cache"])

    loaded = switch_weights(client, list(inf.urls), path, version, held,
                            settings.reload_timeout_s, settings.upstream_check_s, asleep,
                            wake_kv_cache, load)
    timings["reload" if path is not None else "transfer"] = time.monotonic() - t
    resident.weights_version = version
    return Published(version, path, loaded)


def _dtype_name(settings: TrainerSettings) -> str:
    """The servers' dtype as torch names it (bfloat16, float32)."""
    return str(weights.engine_dtype(settings.inference.dtype, settings.model_path)
               ).removeprefix("torch.")


def export(settings: TrainerSettings, resident: Resident, version: int,
           timings: dict[str, float], published: str | None = None) -> Path:
    """``version``'s export in the servers' dtype: the whole model
    (``inference.weight_sync: disk``), or with ``actor_rollout_ref.model.lora_rank`` the
    adapter alone (megabytes, kept in ``weights_dir``: no shared memory needed). The
    ``published`` export is kept whatever ``keep_weight_versions`` says until this one is
    verified."""
    inf = settings.inference
    trainer = resident.trainer
    t = time.monotonic()
    dtype = _dtype_name(settings)
    write = trainer.export_adapter if inf.lora else trainer.export_weights
    if resident.export_root is None and inf.lora:
        resident.export_root = settings.weights_dir
    elif resident.export_root is None:
        size = trainer.parameter_count() * weights.engine_dtype(
            inf.dtype, settings.model_path).itemsize
        # rank 0 writes the export: shared memory only where it runs on this host
        resident.export_root = weights.export_root(
            settings.weights_dir, settings.weights_in_memory and trainer.exports_here,
            list(inf.urls), size, settings.keep_weight_versions)
        log.info("weight exports of %.2f GB go to %s", size / 1e9, resident.export_root)
    path = weights.publish_version(resident.export_root, version,
                                   settings.keep_weight_versions, lambda tmp: write(tmp, dtype),
                                   Path(published) if published else None)
    timings["save"] = time.monotonic() - t
    return path


def verify(client: redis.Redis, settings: TrainerSettings, resident: Resident,
           published: Published, previous: list[float] | None, metrics: Metrics,
           timings: dict[str, float]) -> None:
    """Prove the load with the probe: every loaded server scores the probe as the trainer
    does (and, given the ``previous`` probe, closer to the new weights than to the old);
    only then is the version recorded as published, which the upstream keeper loads into
    a server that restarts.

    A probe that fails leaves the version bumped: the servers do hold that version's
    weights, only not verified ones, and the step fails."""
    t = time.monotonic()
    ids = resident.probe_ids
    expected = resident.trainer.probe_log_probs(ids)
    moved = previous is not None and weights.mean_gap(expected, previous) > \
        settings.probe_tolerance
    served = adapter_name(settings.inference.served_model_name, published.version) \
        if settings.inference.lora else settings.inference.served_model_name
    for url in published.loaded:
        metrics.update(weights.verify_sync(url, served,
                                           expected, previous, settings.probe_tolerance, ids,
                                           settings.inference.data_parallel_size))
        if settings.inference.weight_sync == "transfer" and \
                settings.inference.transfer_checksums:
            # the checksums cover every replica's every tensor (the probe: its output)
            digests = weights.weight_checksums(url, settings.reload_timeout_s)
            metrics.update(weights.check_checksums(url, digests, resident.digests.get(url),
                                                   moved))
            resident.digests[url] = digests
    client.srem(keys.upstreams_stale(), *[u.rstrip("/") for u in published.loaded])
    # the keeper can load these into a restarted server itself (keys.upstreams_need_weights)
    client.delete(keys.upstreams_need_weights())
    resident.probe_prev = expected
    resident.published = True
    timings["probe"] = time.monotonic() - t
    record = {
        "version": str(published.version),
        "path": str(published.path.resolve()) if published.path is not None else "",
        "adapter": served if settings.inference.lora else "",
        "model": settings.inference.served_model_name,
        "probe": json.dumps(expected), "probe_ids": json.dumps(ids)}
    client.hset(keys.policy_published(), mapping=record)
    published_here.verified(record)  # put back if a Redis crash loses this write
    if published.path is not None:  # verified: the exports before it beyond those kept go
        weights.prune_versions(published.path.parent, settings.keep_weight_versions)


def step_metrics(stats: BatchStats, version: int, timings: dict[str, float]) -> Metrics:
    timings = dict(timings)
    out: Metrics = {"timing/gateway_paused_seconds": timings.pop("paused_for")}
    out.update({f"timing/trainer_{k}_seconds": v for k, v in timings.items()})
    rewards = stats.rewards
    out.update({
        "reward/mean": statistics.fmean(rewards) if rewards else None,
        "reward/max": max(rewards) if rewards else None,
        "reward/min": min(rewards) if rewards else None,
        "batch/groups": stats.groups,
        "batch/rollouts": stats.rollouts,
        "batch/samples": stats.samples,
        "batch/excluded_samples": stats.excluded_samples,
        "batch/failed_rollouts_zero_reward": stats.failed_rollouts_zero_reward,
        "batch/rowless_rollouts": len(stats.rowless),
        "batch/small_groups": stats.small_groups,
        "batch/constrained_calls": stats.constrained_calls,
        "batch/continued_calls": stats.continued_calls,
        "batch/overlong_calls": stats.overlong_calls,
        "batch/overlong_masked_calls": stats.overlong_masked_calls,
        "reward/overlong_penalty_mean": statistics.fmean(stats.penalties)
        if stats.penalties else 0.0,
        "batch/mixed_version_samples": stats.mixed_version_samples,
        "batch/mixed_version_tokens": stats.mixed_version_tokens,
        "policy/sample_version_lag_mean": statistics.fmean(
            [version - 1 - v for v in stats.versions]) if stats.versions else 0.0,
        "policy/version": version,
    })
    return out


def record(client: redis.Redis, run_id: str, step: int, group_ids: list[str],
           metrics: Metrics, settings: TrainerSettings) -> None:
    client.set(keys.run_step_result(run_id, step), json.dumps(metrics))
    # a redelivery returns the stored result: what the groups captured is not read again
    retention.release_trained(client, group_ids, settings.trained_data_ttl_s)


def save_if_due(client: redis.Redis, settings: TrainerSettings, resident: Resident,
                run_id: str, step: int, version: int, metrics: Metrics) -> None:
    done = step + 1
    if not settings.save_due(done):
        return
    # what the checkpoint records is taken now; only the writing may run in the background
    write = partial(checkpoint.save_checkpoint, resident.trainer, settings.checkpoint_dir,
                    run_id, done, version, client.hgetall(keys.run(run_id)),
                    rng=checkpoint.rng_state())
    if done < settings.total_steps and settings.saves_in_background(resident.trainer.device):
        resident.saves.start(done, write)
        return
    t = time.monotonic()
    write()
    metrics["timing/trainer_checkpoint_seconds"] = time.monotonic() - t


def save_missing(client: redis.Redis, settings: TrainerSettings, resident: Resident,
                 run_id: str, version: int) -> None:
    """Save the checkpoint due at the updates ``resident`` holds, if it is not on disk: a
    step whose save failed after its record (a full disk) fails, and its retry answers
    from the record; the last step's, once lost, no later step would write."""
    done = resident.steps_done
    if not settings.save_due(done):
        return
    latest = checkpoint.latest_checkpoint(settings.checkpoint_dir, run_id)
    if latest is not None and checkpoint.checkpoint_step(latest) >= done:
        return
    log.warning("run %s: the checkpoint of step %d is missing (its save failed); saving it "
                "from this worker's trainer, which holds that update", run_id, done)
    checkpoint.save_checkpoint(resident.trainer, settings.checkpoint_dir, run_id, done,
                               version, client.hgetall(keys.run(run_id)))


# --- weight loading -------------------------------------------------------------------

@dataclass
class LoadOutcome:
    """What one attempt to load a version into some servers did, per server."""

    loaded: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # refused the connection
    failed: dict[str, str] = field(default_factory=dict)       # may hold part of the version


Loader = Callable[[list[str]], LoadOutcome]


def disk_loader(path: Path, version: int, timeout: float, frozen_calls: bool) -> Loader:
    """``inference.weight_sync: disk``: each server reloads the export at ``path``."""
    def load(urls: list[str]) -> LoadOutcome:
        out = LoadOutcome()
        for url in urls:
            try:
                weights.reload_weights(url, path, timeout=timeout, frozen_calls=frozen_calls,
                                       version=version)
                out.loaded.append(url)
            except requests.ConnectionError as exc:
                out.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
        return out
    return load


def adapter_loader(path: Path, settings: TrainerSettings, version: int, frozen_calls: bool,
                   metrics: Metrics, fresh_base: bool = False) -> Loader:
    """LoRA: each server serves ``version``'s adapter under its own name (the base weights
    stay), then stops serving the ones before the previous version: every call in flight
    was drained at this pause, and a call that outlived the drain (ended by the gateway,
    perhaps not yet by the engine) names at most the previous one. ``fresh_base``: first
    reload the base weights from the model (a run's start: a previous run may have left
    others there)."""
    inf = settings.inference
    name = adapter_name(inf.served_model_name, version)
    metrics.setdefault("weight_sync/unloaded_adapters", 0)
    keep = {name, adapter_name(inf.served_model_name, version - 1)}
    timeout = settings.reload_timeout_s

    def load(urls: list[str]) -> LoadOutcome:
        out = LoadOutcome()
        for url in urls:
            try:
                if fresh_base:  # a run's start: the base as the model has it
                    weights.reload_weights(url, settings.model_path, timeout)
                weights.load_adapter(url, name, path, timeout, frozen_calls, version)
                out.loaded.append(url)
            except requests.ConnectionError as exc:
                out.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            try:  # the load stands whatever this does
                for old in weights.served_adapters(url, inf.served_model_name):
                    if old not in keep:
                        metrics["weight_sync/unloaded_adapters"] += \
                            weights.unload_adapter(url, old, timeout)
            except requests.RequestException as exc:
                log.warning("%s: older adapters not unloaded (%s); the next load tries again",
                            url, exc)
        return out
    return load


def transfer_loader(resident: Resident, settings: TrainerSettings, version: int,
                    frozen_calls: bool, metrics: Metrics) -> Loader:
    """``inference.weight_sync: transfer``: the trainer sends its weights to the servers
    through vLLM's weight-transfer routes (``transfer.py``), then each resets its prefix
    cache."""
    inf = settings.inference
    dtype = _dtype_name(settings)

    def load(urls: list[str]) -> LoadOutcome:
        # a server that refuses connections now is not worth a gather of the whole model
        # (a step waiting for one to come back would redo it every upstream_check_s)
        down = {u: "ConnectionError: /health refused" for u in urls if not _answers(u)}
        urls = [u for u in urls if u not in down]
        if not urls:
            return LoadOutcome(unreachable=down)
        try:
            sent = resident.trainer.transfer_weights(
                urls, dtype, inf.transfer_bucket_bytes, settings.reload_timeout_s,
                weights.api_key(), inf.transfer_engine)
        except Exception as exc:  # noqa: BLE001 - an error on the trainer's side, mid-way
            # any server may hold part of the version: each is failed (stale, not resumed)
            why = f"the transfer failed on the trainer: {exc.__class__.__name__}: {exc}"
            return LoadOutcome(failed={u: why for u in urls})
        metrics["weight_sync/bytes_moved"] = sent.bytes_moved
        metrics["weight_sync/buckets"] = sent.buckets
        out = LoadOutcome(unreachable={**down, **sent.unreachable}, failed=dict(sent.failed))
        for url in sent.loaded:
            try:
                weights.after_load(url, settings.reload_timeout_s, frozen_calls, version)
                out.loaded.append(url)
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
        return out
    return load


def _answers(url: str) -> bool:
    """The server takes connections (any answer, even an error, says it is up)."""
    try:
        requests.get(url.rstrip("/") + "/health", timeout=5)
        return True
    except requests.ConnectionError:
        return False
    except requests.RequestException:
        return True


def switch_weights(client: redis.Redis, urls: list[str], path: Path | None, version: int,
                   held: weights.Held, wait_s: float, every_s: float,
                   asleep: weights.Held = weights.NOTHING_HELD,
                   wake: Callable[[], None] = lambda: None,
                   load: Loader | None = None) -> list[str]:
    """Load the version (the export at ``path``, or through ``load``) into every reachable
    server, make ``version`` the policy version, run ``wake`` (a collocated step wakes the
    KV caches there), then resume the engines in ``held`` (checked). Returns the servers
    loaded.

    The version is set while the engines are still paused (or asleep), and they run again
    twice ``POLICY_VERSION_MAX_AGE_S`` later: every gateway process then reads the new
    version by the first token a frozen call samples on the new weights, and places the
    switch there. That holds for the wake too: vLLM resumes an engine's scheduler once it
    is fully awake. An engine loaded here that this step did not pause but reports paused
    was left so by a dead trainer: it is resumed with the others (paused, it would fail the
    probe)."""
    if load is None:
        assert path is not None
        load = disk_loader(path, version, wait_s, held.frozen_calls)
    loaded = _reload_reachable(client, urls, load, version, wait_s, every_s, held, asleep)
    client.set(keys.policy_version(), version)
    published_here.published(version)  # put back if a Redis crash loses this write
    # (an engine asleep reports paused until it wakes whole)
    left = [u.rstrip("/") for u in loaded if u.rstrip("/") not in held.urls
            and u.rstrip("/") not in asleep.urls and weights.in_state(u, weights.PAUSE)]
    if left:
        log.warning("%s: left paused by a dead trainer; resumed on version %d",
                    ", ".join(left), version)
    if held.urls or left or asleep.urls:
        time.sleep(2 * POLICY_VERSION_MAX_AGE_S)
    wake()
    if held.urls or left:
        orphans = weights.Held(weights.PAUSE, left)
        try:
            held.release()
        finally:
            orphans.release()
    return loaded


def send_again(resident: Resident, settings: TrainerSettings, url: str, version: int,
               frozen_calls: bool) -> None:
    """The upstream keeper's load of a restarted server under ``weight_sync: transfer``:
    the trainer's weights, only while they are still ``version`` (between an update and
    its publish they are not, and the step's own load reaches that server)."""
    busy = weights.WeightSyncError(
        f"{url}: the trainer's weights are not policy version {version} now (an update or "
        "a checkpoint is under way); the step's own load reaches this server")
    lock = resident.trainer.ranks.lock
    # not waiting: the keeper holds the publish lock, and an update can take minutes
    if not lock.acquire(blocking=False):
        raise busy
    try:  # no update starts meanwhile
        if resident.weights_version != version:
            raise busy
        out = transfer_loader(resident, settings, version, frozen_calls, {})([url])
    finally:
        lock.release()
    if url not in out.loaded:
        why = {**out.unreachable, **out.failed}.get(url, "not loaded")
        raise weights.WeightSyncError(f"{url}: weight transfer of version {version}: {why}")


def _reload_reachable(client: redis.Redis, urls: list[str], load: Loader, version: int,
                      wait_s: float, every_s: float, held: weights.Held,
                      asleep: weights.Held = weights.NOTHING_HELD) -> list[str]:
    """Load the version into every server that answers; returns those. A server that is
    down is marked stale (the upstream keeper loads it when it is back, the gateway routes
    around it meanwhile). With none reachable, keep trying for ``wait_s`` (the gateway stays
    paused: a restarted server must hold the current weights before agents reach it).

    A load that fails or outlasts ``wait_s`` (``trainer.reload_timeout_s``) may have left
    part of the new weights in the engine: that server is marked stale too, and is left
    out of ``held``, so it is not resumed on them, and out of ``asleep`` (woken now,
    unchecked: never left asleep; the keeper restores it). A server unreachable at the end
    is left out of both (nothing to resume or wake; it comes back fresh).
    ``held.frozen_calls``: requests wait frozen in the engines (their KV is dropped too)."""
    deadline = time.monotonic() + wait_s
    errors: dict[str, str] = {}
    failed: dict[str, str] = {}
    while True:
        out = load([u for u in urls if u not in failed])
        for url, why in out.unreachable.items():
            client.sadd(keys.upstreams_stale(), url.rstrip("/"))
            if url not in errors:
                log.warning("inference server %s is unreachable; it gets version %d when "
                            "it is back", url, version)
            errors[url] = why
        for url, why in out.failed.items():
            client.sadd(keys.upstreams_stale(), url.rstrip("/"))
            held.forget(url)
            if url.rstrip("/") in asleep.urls:
                asleep.forget(url)
                weights.wake_engines([url], asleep.timeout, check=False)
            failed[url] = why
            log.error("inference server %s did not load version %d: %s; it is not "
                      "resumed, and serves nobody until the upstream keeper has loaded "
                      "the current weights into it", url, version, why)
        loaded = out.loaded
        if loaded:
            for url in errors:  # still unreachable: it restarts fresh, nothing to undo
                if url not in loaded:
                    held.forget(url)
                    asleep.forget(url)
            return loaded
        if len(failed) == len(urls):
            raise weights.WeightSyncError(
                f"no inference server loaded version {version}: "
                + "; ".join(f"{u} ({e})" for u, e in {**errors, **failed}.items()))
        if time.monotonic() >= deadline:
            raise weights.WeightSyncError(
                f"no inference server could be reached to load version {version} within "
                f"{wait_s:.0f} s (Connection refused or lost): "
                + "; ".join(f"{u} ({e})" for u, e in {**errors, **failed}.items()))
        time.sleep(every_s)


# --- serving the resident weights without an update -----------------------------------

def _serve_resident(client: redis.Redis, settings: TrainerSettings, resident: Resident,
                    beats: Beats, metrics: Metrics) -> int:
    """Make every inference server serve the resident weights as they are (no update):
    pause, drain, publish, verify, resume. Returns the new policy version."""
    pause = Pause(client, settings.lease_ttl_s)
    timings: dict[str, float] = {}
    with paused(pause, settings, beats, timings):
        pause.drain(settings.drain_timeout_s)
        require_pause(pause, "loading the weights")
        published = publish(client, settings, resident, timings, metrics, fresh_base=True)
        # what the servers held before is unknown: no "closer to new than old" check
        verify(client, settings, resident, published, None, metrics, timings)
    return published.version


def _restore_servers(client: redis.Redis, settings: TrainerSettings, resident: Resident,
                     beats: Beats, step: int) -> Metrics:
    """This process took up a run mid-way (its previous trainer worker died, or a resumed
    driver's worker reloaded the checkpoint): bring every inference server back to the
    weights it restored before training on; -> the rollback's metrics."""
    restored = resident.restored_step or 0  # updates the checkpoint holds (0: none)
    lost = max(step - restored, 0)
    log.warning("trainer worker took up run %s at step %d: restored %s, so %d update(s) "
                "are lost (trainer.save_freq %d); loading those weights into the inference "
                "servers", resident.run_id, step,
                "no checkpoint (none yet): the initial weights" if resident.restored_step
                is None else f"the checkpoint of step {resident.restored_step}", lost,
                settings.save_freq)
    version = _serve_resident(client, settings, resident, beats, {})
    return {"trainer/restored_from_step": resident.restored_step,
            "trainer/restored_policy_version": version,
            "trainer/rolled_back_updates": lost}


def holds_latest(client: redis.Redis, resident: Resident, run_id: str) -> bool:
    """``resident``'s weights are run ``run_id``'s latest: every update it ran was recorded,
    its last step has a stored result, and no later step has one (no other trainer worker
    trained past it meanwhile)."""
    if resident.run_id != run_id or (resident.unrecorded
                                      and resident.updated_step != resident.steps_done):
        return False
    n = resident.steps_done
    return (n == 0 or bool(client.exists(keys.run_step_result(run_id, n - 1)))) \
        and not client.exists(keys.run_step_result(run_id, n))


def init_run(client: redis.Redis, run_id: str) -> Metrics:
    """Load the run's policy into this worker (from its last checkpoint, if any; kept as it
    is when this worker's trainer already holds the run's latest weights) and make every
    inference server serve exactly it (a previous run may have left other weights there).
    Verified by the probe."""
    cfg, settings = _task_start(client, run_id)
    metrics: Metrics = {}
    # the build is inside the heartbeat: a 7B engine or a checkpoint restore takes minutes,
    # and the driver must see a trainer at work, not "no trainer worker took the task"
    with Beats(client, keys.trainer_heartbeat(run_id, "init"), settings.heartbeat_s) as beats:
        take_back_orphans(client, settings)
        kept = _resident if _resident is not None and holds_latest(client, _resident,
                                                                   run_id) else None
        if kept is not None:
            # a restarted driver: this worker's trainer is the run's, reloading the last
            # checkpoint would throw away the updates made since
            log.info("run %s: this worker's trainer holds the run's latest weights (%d "
                     "updates); kept", run_id, kept.steps_done)
            try:  # a checkpoint still being written: the engine is not used meanwhile
                kept.saves.wait()
            except checkpoint.CheckpointError as exc:
                log.error("%s", exc)  # written again below (save_missing)
        else:
            close_resident()
        # the updates the run recorded: one more than the driver's step counter when a
        # driver died between a step's record and the counter's increment
        recorded = recorded_steps(client, run_id, read_run(client, run_id).step)
        resident = resident_trainer(run_id, cfg, settings, recorded=recorded)
        if resident is not kept and recorded > (resident.restored_step or 0):
            # the checkpoint lacks updates the run recorded: served as a take-over in a step
            # is, and the next step's metrics report them (the driver warns with them)
            resident.rollback = _restore_servers(client, settings, resident, beats, recorded)
            metrics.update(resident.rollback)
            version = resident.rollback["trainer/restored_policy_version"]
        else:
            version = _serve_resident(client, settings, resident, beats, metrics)
        if resident is kept:
            save_missing(client, settings, resident, run_id, version)
    metrics["policy/version"] = version
    metrics["resumed_from_step"] = resident.restored_step
    return metrics


def restore_servers(client: redis.Redis, run_id: str) -> Metrics:
    """The upstream keeper could not give a restarted server the run's weights
    (``keys.upstreams_need_weights``: they went by weight transfer from a trainer this
    worker no longer holds, or their export is gone), and the driver, waiting for groups,
    asks for them: load the run's trainer here if this worker holds none (its last
    checkpoint, as a take-over does), make every server serve its weights under a new
    policy version (the verified publish clears the request), and report the updates lost
    with the next step's metrics."""
    if not client.exists(keys.upstreams_need_weights()):
        return {}  # another copy of this task, or a step's load, restored them meanwhile
    step = read_run(client, run_id).step  # the step being collected (a late copy: now's)
    cfg, settings = _task_start(client, run_id)
    with Beats(client, keys.trainer_heartbeat(run_id, "restore"),
               settings.heartbeat_s) as beats:
        take_back_orphans(client, settings)
        resident = resident_trainer(run_id, cfg, settings,
                                    recorded=recorded_steps(client, run_id, step))
        if resident.published:  # the trainer is here: only the servers lost its weights
            metrics = {"trainer/restored_policy_version":
                       _serve_resident(client, settings, resident, beats, {})}
        else:
            metrics = _restore_servers(client, settings, resident, beats, step)
            resident.rollback = metrics
    return metrics

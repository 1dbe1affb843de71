"""The resident trainer: the run this worker process trains, its model and optimizer kept
between steps, and how a process takes a run up from another.

A trainer process that takes up a run it did not start (the previous worker died, or a
resumed driver's worker) restores the run's last checkpoint and loads those weights into
every inference server before it trains: the servers, the trainer and the policy version
agree again, and the next step's metrics report the updates lost (``rollback``). A
checkpoint holding more updates than the run recorded (a Redis crash lost the latest
records) is passed over, so no step is trained twice; a torn newest checkpoint gives way to
the one before. Each task first takes back the engines a dead trainer left paused or asleep
(``take_back_orphans``).

Tasks: ``init_run`` (a run's start or resume), ``restore_servers`` (the keeper could not
give a restarted server the run's weights); a step (``step.py``) calls ``take_over`` itself
when this process has not yet published the run's weights.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import redis

from app.config.schema import Config
from app.config.secrets import inference_api_key
from app.state import keys
from app.state.pause import Pause
from app.state.runs import read_run, run_config
from workers.trainer import checkpoint, weights
from workers.trainer.engine import EngineTrainer
from workers.trainer.gateway_pause import paused, require_pause
from workers.trainer.keeper import left_held, running_keeper
from workers.trainer.liveness import Beats
from workers.trainer.publish import publish, verify
from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync import weight_sync_for
from workers.trainer.weight_sync.base import Metrics

log = logging.getLogger(__name__)


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


def resident_trainer(run_id: str, cfg: Config, settings: TrainerSettings,
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
    trainer, meta = _load_checkpoint(trainer, cfg, settings, run_id)
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
        keeper.send_weights = weight_sync_for(settings).sender(resident)
    _resident = resident
    return resident


def _load_checkpoint(trainer: EngineTrainer, cfg: Config, settings: TrainerSettings,
                     run_id: str) -> tuple[EngineTrainer, checkpoint.CheckpointMeta | None]:
    """The run's newest complete checkpoint loaded into ``trainer`` (or into a new one, if
    the newest was torn); -> the trainer and the checkpoint's meta (None: none)."""
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
        return trainer, meta
    return trainer, None


def recorded_steps(client: redis.Redis, run_id: str, step: int) -> int:
    """The updates run ``run_id`` has recorded, ``step`` being the driver's step counter: a
    driver that died between a step's record and its counter's increment is one behind."""
    while client.exists(keys.run_step_result(run_id, step)):
        step += 1
    return step


def task_start(client: redis.Redis, run_id: str) -> tuple[Config, TrainerSettings]:
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


# --- serving the resident weights without an update -----------------------------------

def serve_resident(client: redis.Redis, settings: TrainerSettings, resident: Resident,
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


def take_over(client: redis.Redis, settings: TrainerSettings, resident: Resident,
              beats: Beats, step: int) -> tuple[int, Metrics]:
    """This process took up a run mid-way (its previous trainer worker died, or a resumed
    driver's worker reloaded the checkpoint): bring every inference server back to the
    weights it restored before training on; -> (the policy version they serve, the
    rollback's metrics)."""
    restored = resident.restored_step or 0  # updates the checkpoint holds (0: none)
    lost = max(step - restored, 0)
    log.warning("trainer worker took up run %s at step %d: restored %s, so %d update(s) "
                "are lost (trainer.save_freq %d); loading those weights into the inference "
                "servers", resident.run_id, step,
                "no checkpoint (none yet): the initial weights" if resident.restored_step
                is None else f"the checkpoint of step {resident.restored_step}", lost,
                settings.save_freq)
    version = serve_resident(client, settings, resident, beats, {})
    return version, {"trainer/restored_from_step": resident.restored_step,
                     "trainer/restored_policy_version": version,
                     "trainer/rolled_back_updates": lost}


def init_run(client: redis.Redis, run_id: str) -> Metrics:
    """Load the run's policy into this worker (from its last checkpoint, if any; kept as it
    is when this worker's trainer already holds the run's latest weights) and make every
    inference server serve exactly it (a previous run may have left other weights there).
    Verified by the probe."""
    cfg, settings = task_start(client, run_id)
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
            version, resident.rollback = take_over(client, settings, resident, beats,
                                                   recorded)
            metrics.update(resident.rollback)
        else:
            version = serve_resident(client, settings, resident, beats, metrics)
        if resident is kept:
            save_missing(client, settings, resident, run_id, version)
    metrics["policy/version"] = version
    metrics["resumed_from_step"] = resident.restored_step
    return metrics


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
    cfg, settings = task_start(client, run_id)
    with Beats(client, keys.trainer_heartbeat(run_id, "restore"),
               settings.heartbeat_s) as beats:
        take_back_orphans(client, settings)
        resident = resident_trainer(run_id, cfg, settings,
                                    recorded=recorded_steps(client, run_id, step))
        metrics: Metrics
        if resident.published:  # the trainer is here: only the servers lost its weights
            metrics = {"trainer/restored_policy_version":
                       serve_resident(client, settings, resident, beats, {})}
        else:
            _, metrics = take_over(client, settings, resident, beats, step)
            resident.rollback = metrics
    return metrics

"""One update cycle, read top to bottom in ``_train_step``, each phase timed:

claim the step's groups -> pause the gateway -> drain -> update (with the engines asleep on
GPU) -> publish (save, reload every server, bump the policy version) -> verify with a probe
-> resume the gateway -> record -> save a checkpoint when due.

Where the update runs outside the pause (``trainer.pause_during_update`` false, or auto on
CPU) it comes right after the claim and rollouts go on meanwhile. ``gateway.drain_mode``
picks the drain (``drain.py``); keep and abort hold the engines paused, and they resume
right after the version bump, before the probe (which needs them running). The publish and
its partial failures are ``publish.py``; the way the weights travel, ``weight_sync/``; the
resident trainer and a take-over of the run, ``resident.py``.

Invariants:
- The gateway is resumed whatever happens after the pause, and the pause is a lease
  (``gateway_pause.py``).
- An engine paused or put to sleep by a step is resumed or woken whatever happens after
  (``weights.Held`` as a context manager).
- A step is trained at most once, a group in at most one step (``once.py``: the four
  records that keep it).
- A trainer process that takes up a run it did not start restores the run's last
  checkpoint and loads those weights into every inference server before it trains
  (``resident.take_over``).
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import ExitStack
from functools import partial

import redis

from app.config.schema import Config
from app.state import keys
from app.state.pause import Pause
from workers.trainer import checkpoint, once, weights
from workers.trainer.batch import BatchStats, Sample, collect_samples
from workers.trainer.drain import drain_for
from workers.trainer.errors import StepError
from workers.trainer.gateway_pause import paused, require_pause
from workers.trainer.liveness import Beats
from workers.trainer.publish import publish, verify
from workers.trainer.resident import (
    Resident,
    resident_trainer,
    take_back_orphans,
    take_over,
    task_start,
)
from workers.trainer.settings import TrainerSettings
from workers.trainer.verl_batch import to_verl_batch
from workers.trainer.weight_sync.base import Metrics

__all__ = ["StepError", "train_step"]

log = logging.getLogger(__name__)


def train_step(client: redis.Redis, run_id: str, step: int) -> Metrics:
    done = once.stored_answer(client, run_id, step)
    if done is not None:
        return done
    cfg, settings = task_start(client, run_id)
    with Beats(client, keys.trainer_heartbeat(run_id, str(step)), settings.heartbeat_s) as beats:
        take_back_orphans(client, settings)
        return _train_step(client, run_id, step, cfg, settings, beats)


def _train_step(client: redis.Redis, run_id: str, step: int, cfg: Config,
                settings: TrainerSettings, beats: Beats) -> Metrics:
    resident = resident_trainer(run_id, cfg, settings, step, recorded=step)
    metrics: Metrics = {}
    timings: dict[str, float] = {}
    # this step's update already ran here and only its publish failed: publish it again
    redo = once.update_already_in_weights(resident, step)
    if redo:
        metrics.update(resident.update_metrics)
    if resident.saves.pending:
        # the previous step's checkpoint, written while this step's groups were collected
        metrics["timing/trainer_wait_for_checkpoint_seconds"] = resident.saves.wait()
        metrics["timing/trainer_background_checkpoint_seconds"] = resident.saves.last_write_s
    if not resident.published and not redo:
        metrics.update(take_over(client, settings, resident, beats, step)[1])
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
        if redo:
            once.publishing_again(resident)
        published = publish(client, settings, resident, timings, metrics, asleep, held)
        verify(client, settings, resident, published, resident.probe_prev, metrics, timings)
    version = published.version
    metrics.update(step_metrics(stats, version, timings))
    once.record(client, run_id, step, group_ids, metrics, settings.trained_data_ttl_s)
    resident.unrecorded, resident.steps_done, resident.rollback = False, step + 1, {}
    resident.updated_step, resident.update_metrics = None, {}
    save_if_due(client, settings, resident, run_id, step, version, metrics)
    return metrics


# --- the phases, in order -------------------------------------------------------------

def claim(client: redis.Redis, run_id: str, step: int, settings: TrainerSettings
          ) -> tuple[list[str], list[Sample], BatchStats]:
    """The step's groups, each claimed for this step only, and their samples."""
    group_ids = once.claim_groups(
        client, client.lrange(keys.run_step_groups(run_id, step), 0, -1), step)
    samples, stats = collect_samples(client, group_ids, settings.zero_reward_failures,
                                     settings.min_group_rewards, settings.overlong)
    if not samples and not stats.rollouts:
        raise StepError(f"step {step}: no rollouts in {len(group_ids)} groups")
    return group_ids, samples, stats


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

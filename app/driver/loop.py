"""The training driver: collect, select, update, log; repeat for ``trainer.total_steps``.

Reads top to bottom: one iteration is one optimizer step. The driver never touches token
data; it moves group ids and asks the trainer worker (queue ``trainer``) for each update.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
from omegaconf import OmegaConf

from app.config import ConfigError
from app.config.loader import flat_keys, repo_path
from app.driver.collector import Collector, Starved
from app.driver.evaluation import Evaluator
from app.driver.lease import DriverLease, RunBusy
from app.driver.metrics import MetricsSink, console_line, step_metrics, val_line
from app.driver.preflight import preflight
from app.driver.recovery import OutageWatch, repair
from app.driver.restore import ServerRestore
from app.driver.trainer_call import call_trainer
from app.state import keys
from app.state.connection import connect, redact, resolve_redis_url
from app.state.policy import current_version
from app.state.records import RunRecord
from app.state.runs import MissingState, read_run, run_config

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    pass


def _require_gateway_agrees(cfg: Any) -> None:
    """Refuse a run whose config differs from the running gateway's on what the gateway
    serves by (``app/config/serving.py``): it would train on what it did not ask for."""
    from app.services.health import gateway_disagreements

    found = gateway_disagreements(cfg)
    refused, noted = found if found is not None else ([], [])
    for line in noted:
        log.warning("%s (the default of calls whose agent sets none)", line)
    if refused:
        raise ConfigError([*refused, "the gateway reads its own config, once, when the stack "
                           "starts: start the stack with this run's config (carryover up with "
                           "the same file and overrides), or give the run the stack's values"])


def _require_same_config(given: Any, stored: Any, run_id: str, keys: Iterable[str]) -> None:
    """Refuse to resume with a file or overrides (``keys``: what they set) that differ from
    the run's config: the run goes on with its own (its trainer and workers read the stored
    one), so a changed value would be ignored without a word. Keys left to their defaults
    are not compared: the run keeps the defaults it started with."""
    mine = flat_keys(OmegaConf.to_container(given, resolve=True), into_free_form=True)
    theirs = flat_keys(OmegaConf.to_container(stored, resolve=True), into_free_form=True)
    differ = [f"{key}: value {mine.get(key)!r} differs from run {run_id}'s {theirs.get(key)!r}"
              for key in sorted(keys) if mine.get(key) != theirs.get(key)]
    if differ:
        raise ConfigError([*differ, f"--resume {run_id} goes on with the config the run "
                           "started with: give the same file and overrides, or start a new "
                           "run"])


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_dir_for(cfg: Any, run_id: str) -> Path:
    return repo_path(str(cfg.logging.dir)) / run_id


def run_training(cfg: Any, resume: str | None = None, *, given: Iterable[str] = (),
                 on_step: Callable[[int, dict], None] | None = None,
                 run_id: str | None = None) -> int:
    """Entry point of ``carryover train``; returns an exit code."""
    os.environ["CARRYOVER_ROLE"] = "driver"  # names the process in what it records
    try:
        result = train(cfg, resume=resume, on_step=on_step, run_id=run_id, given=given)
    except TrainingFailed as exc:
        log.error("%s", exc)
        return 1
    print(f"run {result['run_id']} finished: {result['steps']} steps; "
          f"metrics in {result['run_dir']}/metrics.jsonl")
    return 0


def train(cfg: Any, resume: str | None = None, *, given: Iterable[str] = (),
          on_step: Callable[[int, dict], None] | None = None,
          run_id: str | None = None,
          should_stop: Callable[[int, dict], bool] | None = None,
          on_eval: Callable[[int, dict], None] | None = None) -> dict:
    """Run (or resume) a run for ``trainer.total_steps``; ``should_stop(step, metrics)``,
    asked after each step, ends it early (a benchmark that reached its steady state).
    ``on_eval(step, metrics)`` gets each evaluation's ``val/*`` metrics (``data.val_files``),
    reported after ``step`` updates. Resumed, the run goes on with its stored config, and
    ``given`` (the keys the caller's file and overrides set) must agree with it."""
    from app.celery_app import celery_app

    url = resolve_redis_url(cfg)
    if celery_app.conf.carryover_redis_url != url:
        raise TrainingFailed("the Celery app was built for another Redis than the run's config "
                             "(set $CARRYOVER_CONFIG / $REDIS_URL before importing app.celery_app)")
    client = connect(url, reconnect_s=float(cfg.redis.reconnect_s))
    if resume:
        try:
            record = read_run(client, resume)
            stored = run_config(client, resume)  # the run keeps the config it started with
        except MissingState:
            raise TrainingFailed(f"--resume {resume}: no such run in the Redis at "
                                 f"{redact(url)} (a run id is printed when its run "
                                 "starts, and names its folder under logging.dir)") from None
        if record.status == "finished":
            # its final evaluations would run and be reported a second time
            raise TrainingFailed(f"run {resume} already finished ({record.step} steps); "
                                 "start a new run instead of resuming it")
        _require_same_config(cfg, stored, resume, given)
        cfg = stored
    _require_gateway_agrees(cfg)
    samples = preflight(cfg)  # a bad data file or agent stops the run before it is recorded
    # Each Redis outage the driver rides out is followed by a check of what it lost (see
    # app/driver/recovery.py): the last second of acknowledged writes may be gone.
    watch = OutageWatch(url)
    if resume:
        run_id = resume
    else:
        run_id = run_id or new_run_id()
        Collector.create_run(client, run_id, OmegaConf.to_container(cfg, resolve=True),
                             "async" if cfg.agentlightning.async_rollout.enabled else "sync")
    lease = DriverLease(client, run_id)
    try:
        lease.acquire()
    except RunBusy as exc:
        watch.close()
        raise TrainingFailed(str(exc)) from None
    try:
        return _drive(client, cfg, run_id, resume, lease, watch, samples, on_step,
                      should_stop, on_eval)
    finally:
        lease.release()


def _drive(client: redis.Redis, cfg: Any, run_id: str, resume: str | None,
           lease: DriverLease, watch: OutageWatch, samples: list[dict],
           on_step: Callable[[int, dict], None] | None,
           should_stop: Callable[[int, dict], bool] | None,
           on_eval: Callable[[int, dict], None] | None) -> dict:
    """The run, once this driver holds its lease."""
    collector = Collector(client, run_id, cfg, samples=samples)
    evaluator = Evaluator(client, run_id, cfg)  # reads data.val_files: fails before training
    restore_servers = ServerRestore(client, cfg, run_id)  # servers the keeper cannot restore
    run_dir = run_dir_for(cfg, run_id)
    sink = MetricsSink(run_dir, run_id, cfg, console=bool(cfg.logging.console))
    total = int(cfg.trainer.total_steps)
    record = read_run(client, run_id)  # what a resumed run kept: its step, evaluation, counts
    step = record.step
    if resume:
        sink.catch_up(client.lindex(keys.run_metrics(run_id), -1))
    else:
        log.info("run %s started (metrics in %s; after a crash: carryover train --resume "
                 "%s)", run_id, run_dir, run_id)
    # The engine must serve this run's policy before any rollout of it starts.
    try:
        call_trainer(client, cfg, "workers.trainer.tasks.init_run", run_id, "init", [run_id])
    except Exception as exc:
        raise TrainingFailed(f"the trainer worker could not load run {run_id}'s policy into "
                             f"the inference server: {exc.__class__.__name__}: {exc}") from exc
    if resume:  # what the dead driver recorded and did not send, now on the run's policy
        resent = collector.resend_unsent()
        log.info("resuming run %s at step %d with %d active groups (%d re-sent)",
                 run_id, step, collector.active_count(), resent)
        evaluator.adopt(current_version(client))

    def report_eval(steps_done: int, val: dict[str, float] | None) -> None:
        if val is None:
            return
        pipe = client.pipeline()  # the report and its mark together: never one twice
        pipe.rpush(keys.run_metrics(run_id), json.dumps({"step": steps_done, **val}))
        pipe.hset(keys.run(run_id), RunRecord.field("evaluated_step"), steps_done)
        pipe.execute()
        sink.log(steps_done, val)
        if on_eval:
            on_eval(steps_done, val)
        elif cfg.logging.console:
            print(val_line(steps_done, val), flush=True)

    # evaluated_step: -1 unless a resumed run reported one
    if step == 0 and evaluator.before_training() and record.evaluated_step < 0:
        # the initial policy alone: waited for before any training rollout is sent (a
        # resumed run's may be running still, taken up)
        if evaluator.pending is None:
            evaluator.start(0, current_version(client))
        report_eval(0, evaluator.wait(on_wait=restore_servers))
    # the counters as the last step's metrics counted them: what happened since (a resumed
    # run's groups dropped while no driver ran) goes into the next step's
    last_counters = record.counted or collector.counters()
    n = collector.n
    is_async = bool(cfg.agentlightning.async_rollout.enabled)
    refill_during_update = cfg.agentlightning.async_rollout.refill == "during_update"
    carried = collector.carried_in()
    last_entry: dict[str, Any] | None = None  # the metrics entry of the last step done
    chosen: list[str] | None = None           # the current step's selection, once made

    def still_driving() -> None:
        """Before anything that changes the run: the lease is still this driver's."""
        if lease.lost.is_set():
            raise TrainingFailed(f"run {run_id} was taken over by another driver; this one "
                                 "stops")

    def after_outage() -> None:
        outage = watch.take()
        if outage is not None:
            repair(client, collector, run_id, outage, step, chosen, last_entry, last_counters)

    try:
        while step < total:
            still_driving()
            after_outage()
            chosen = None
            t_step = time.monotonic()
            version = current_version(client)
            prev_carry = carried
            collector.cancel_stale(step)
            collector.top_up(version)
            groups_key = keys.run_step_groups(run_id, step)
            if client.exists(groups_key):  # resumed after selecting, before the update ended
                sel_groups = client.lrange(groups_key, 0, -1)
                selection = collector.selected(step)  # its figures, as they were
                waited = 0.0
            else:
                serving = [version]

                def on_wait(serving: list[int] = serving) -> None:
                    still_driving()
                    after_outage()
                    # servers the keeper cannot restore: no group would finish without them
                    if restore_servers() is not None:  # they serve a new version now
                        serving[0] = current_version(client)
                    collector.top_up(serving[0])
                    evaluator.feed()  # a periodic evaluation's next prompts, behind training's

                waited = collector.wait_ready(on_wait=on_wait, step=step)
                version = serving[0]
                selection = collector.select(step, prev_carry, waited)
                sel_groups = selection.group_ids
            chosen = list(sel_groups)
            if selection is not None:
                carried = selection.new_carry_over_rollouts
            # during_update: the freed slots work while the trainer does, on the old weights,
            # so their age counts from this step like the rest of this step's dispatch.
            # after_update: the loop's top_up at the next step starts them on the new ones.
            refill_early = is_async and step + 1 < total and refill_during_update

            def refill(v: int = version, s: int = step) -> None:
                still_driving()
                # a slot freed once the step's weights are loaded starts on them: its age
                # counts from the next step, as after_update's refill does
                now = current_version(client)
                if now == v:
                    # this step, or the next where its update is done already (a resumed
                    # step's: its version was read after the update)
                    collector.top_up(v)
                else:
                    collector.top_up(now, dispatch_step=s + 1)

            def while_training(refill_early: bool = refill_early) -> None:
                if refill_early:
                    refill()
                else:
                    still_driving()
                evaluator.feed()

            t_train = time.monotonic()
            try:
                trainer_metrics = call_trainer(
                    client, cfg, "workers.trainer.tasks.train_step", run_id, str(step),
                    [run_id, step], while_running=while_training,
                    outage=watch, after_outage=after_outage)
            except (Starved, TrainingFailed):
                raise  # the driver's own refill, not the trainer
            except Exception as exc:
                raise TrainingFailed(f"update {step} failed in the trainer worker: "
                                     f"{exc.__class__.__name__}: {exc}") from exc
            t_end = time.monotonic()
            if trainer_metrics.get("trainer/rolled_back_updates"):
                since = trainer_metrics.get("trainer/restored_from_step")
                log.warning("update %d ran in a trainer worker that took the run up from %s: "
                            "%d update(s) since were lost (their weights and optimizer "
                            "state; trainer.save_freq %s)", step,
                            "the initial weights (no checkpoint yet)" if since is None
                            else f"the checkpoint of step {since}",
                            trainer_metrics["trainer/rolled_back_updates"],
                            cfg.trainer.save_freq)
            counters = collector.counters()
            metrics = step_metrics(
                trainer_metrics, selection, len(sel_groups), n, counters, last_counters,
                waited=waited, overdue=collector.age_wait_seconds, update_s=t_end - t_train,
                step_s=t_end - t_step,
                redis_used_memory=int(client.info("memory")["used_memory"]))
            last_counters = counters
            step += 1
            still_driving()  # the step's counter and metrics are written by the lease's holder
            last_entry = {"step": step - 1, **metrics}
            collector.set_step(step, json.dumps(last_entry), counters)
            chosen = None
            sink.log(step - 1, metrics)
            if on_step:
                on_step(step - 1, metrics)
            elif cfg.logging.console:
                print(console_line(step - 1, total, metrics), flush=True)
            # Evaluations run beside training (fed as their groups finish): reported between
            # steps, never waited for.
            report_eval(step - 1, evaluator.poll())
            if evaluator.due(step) and step < total:
                if evaluator.pending is None:
                    evaluator.start(step, current_version(client))
                else:
                    log.warning("evaluation due after %d updates skipped: %s (sent after %d) "
                                "is still running", step, evaluator.pending.eval_id,
                                evaluator.pending.step)
            if should_stop is not None and should_stop(step - 1, metrics):
                break
        # the carry-over is of no use to a finished run: its agents stop now, before the final
        # evaluation's rollouts need the slots
        still_driving()
        collector.cancel_all()
        if step >= total and evaluator.freq > 0 and evaluator.enabled \
                and read_run(client, run_id).evaluated_step < step:
            # the final policy is always measured (verl's last validation), once: a resumed
            # driver may have taken the final evaluation up already
            if evaluator.pending is None or evaluator.pending.step < step:
                report_eval(step - 1, evaluator.wait(on_wait=restore_servers))
                evaluator.start(step, current_version(client))
            report_eval(step, evaluator.wait(on_wait=restore_servers))
        client.hset(keys.run(run_id), "status", "finished")
    except Starved as exc:
        raise TrainingFailed(f"step {step}: {exc}") from exc
    finally:
        evaluator.cancel()  # one still running when the run stops or fails
        watch.close()
        sink.close()
    return {"run_id": run_id, "steps": step, "run_dir": str(run_dir),
            "jsonl": str(sink.jsonl_path), "wandb_dir": sink.wandb_dir}

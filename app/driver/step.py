"""One optimizer step of a run, its phases in order: top up, wait, select, train, record.

``Driver`` is a run as this process drives it once it holds the run's lease: its parts (the
collector, the evaluator, the metrics sink, the outage watch) and where the run stands
between steps. ``app.driver.loop`` calls ``begin`` once, ``run_step`` until the run has
its ``trainer.total_steps`` updates, then ``finish`` and ``close``. Evaluations run beside
training and are started and reported between steps; only the one before training and the
final one are waited for.

Invariants:
- Only the lease's holder changes the run: ``still_driving`` is asked before each phase
  that writes to it and at every poll of a wait, and a driver whose lease another took
  over stops.
- A step selects once: a driver resumed after the step's selection (its group list is in
  Redis) trains those groups, with the figures recorded when they were chosen.
- The step counter, the step's metrics entry and the counters it counted up to are written
  in one transaction (``Collector.set_step``), so each entry reports what the counters
  moved by since the one before, across restarts too.
- What a Redis outage lost of the driver's writes is redone from the fields kept here (the
  step in progress, its selection once made, the last entry and the counters it counted;
  ``app.driver.recovery``), before the next write that builds on them.
- An evaluation's report and its ``evaluated_step`` mark are written together: none is
  reported twice, and a resumed run does not run again one it already reported.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from app.config.schema import Config
from app.driver.collector import Collector, Selection, Starved
from app.driver.evaluation import Evaluator
from app.driver.lease import DriverLease
from app.driver.metrics import Metrics, MetricsSink, console_line, step_metrics, val_line
from app.driver.recovery import OutageWatch, repair
from app.driver.restore import ServerRestore
from app.driver.trainer_call import TrainerLost, call_trainer, update_memory_knobs
from app.state import keys
from app.state.policy import current_version
from app.state.records import RunRecord
from app.state.runs import read_run

log = logging.getLogger(__name__)

StepHook = Callable[[int, Metrics], None]  # (updates done or step index, metrics)
EvalHook = Callable[[int, dict[str, float]], None]  # (updates done, an evaluation's val/*)


class TrainingFailed(RuntimeError):
    """The run cannot go on; the message says why (``carryover train`` exits 1 with it)."""


@dataclass
class Batch:
    """The groups a step trains."""
    group_ids: list[str]
    selection: Selection | None  # its figures; None when a resumed step's were never made
    waited: float                # seconds the step waited for them


class Driver:
    """A run as this process drives it: its parts, built once, and where it stands between
    steps (the fields an outage's repair and a step's metrics read)."""

    def __init__(self, client: redis.Redis, cfg: Config, run_id: str, lease: DriverLease,
                 watch: OutageWatch, samples: list[dict[str, object]], run_dir: Path,
                 on_step: StepHook | None = None, on_eval: EvalHook | None = None) -> None:
        self.client, self.cfg, self.run_id = client, cfg, run_id
        self.lease, self.watch = lease, watch
        self.on_step, self.on_eval = on_step, on_eval
        self.collector = Collector(client, run_id, cfg, samples=samples)
        # reads data.val_files: fails before training
        self.evaluator = Evaluator(client, run_id, cfg)
        # servers the keeper cannot restore
        self.restore_servers = ServerRestore(client, cfg, run_id)
        self.run_dir = run_dir
        self.console = bool(cfg.logging.console)
        self.sink = MetricsSink(run_dir, run_id, cfg, console=self.console)
        self.total = int(cfg.trainer.total_steps)
        self.refill_during_update = bool(cfg.agentlightning.async_rollout.enabled) and \
            cfg.agentlightning.async_rollout.refill == "during_update"
        # Where the run stands; read back from Redis by ``begin``.
        self.step = 0            # the step in progress: the updates done
        self.version = 0         # the policy version the servers serve, as last read
        self.carried = 0         # unfinished rollouts the last selection carried over
        # the counters as the last step's metrics counted them
        self.last_counters: dict[str, int] = {}
        self.last_entry: Metrics | None = None  # the metrics entry of the last step
        self.chosen: list[str] | None = None  # the step's selection, once made

    # --- before the first step and after the last ------------------------------------------

    def begin(self, resume: bool) -> None:
        """The run's policy served, a resumed run's state taken up, the initial policy
        evaluated (``trainer.val_before_train``)."""
        record = read_run(self.client, self.run_id)  # a resumed run's step, evaluation, counts
        self.step = record.step
        if resume:
            self.sink.catch_up(self.client.lindex(keys.run_metrics(self.run_id), -1))
        else:
            log.info("run %s started (metrics in %s; after a crash: carryover train --resume "
                     "%s)", self.run_id, self.run_dir, self.run_id)
        # The engine must serve this run's policy before any rollout of it starts.
        try:
            call_trainer(self.client, self.cfg, "workers.trainer.tasks.init_run", self.run_id,
                         "init", [self.run_id])
        except Exception as exc:
            raise TrainingFailed(f"the trainer worker could not load run {self.run_id}'s "
                                 f"policy into the inference server: "
                                 f"{exc.__class__.__name__}: {exc}") from exc
        if resume:  # what the dead driver recorded and did not send, now on the run's policy
            resent = self.collector.resend_unsent()
            log.info("resuming run %s at step %d with %d active groups (%d re-sent)",
                     self.run_id, self.step, self.collector.active_count(), resent)
            self.evaluator.adopt(current_version(self.client))
        # evaluated_step: -1 unless a resumed run reported one
        if self.step == 0 and self.evaluator.before_training() and record.evaluated_step < 0:
            # the initial policy alone: waited for before any training rollout is sent (a
            # resumed run's may be running still, taken up)
            if self.evaluator.pending is None:
                self.evaluator.start(0, current_version(self.client))
            self._report_eval(0, self.evaluator.wait(on_wait=self.restore_servers))
        # read after that wait: what happened since the last step's metrics (a resumed run's
        # groups dropped while no driver ran) goes into the next step's
        self.last_counters = record.counted or self.collector.counters()
        self.carried = self.collector.carried_in()

    def finish(self) -> None:
        """The run ends: its carry-over cancelled, the final policy evaluated, the run
        marked finished."""
        # the carry-over is of no use to a finished run: its agents stop now, before the
        # final evaluation's rollouts need the slots
        self.still_driving()
        self.collector.cancel_all()
        evaluator = self.evaluator
        if self.step >= self.total and evaluator.freq > 0 and evaluator.enabled \
                and read_run(self.client, self.run_id).evaluated_step < self.step:
            # the final policy is always measured (verl's last validation), once: a resumed
            # driver may have taken the final evaluation up already
            if evaluator.pending is None or evaluator.pending.step < self.step:
                self._report_eval(self.step - 1, evaluator.wait(on_wait=self.restore_servers))
                evaluator.start(self.step, current_version(self.client))
            self._report_eval(self.step, evaluator.wait(on_wait=self.restore_servers))
        self.client.hset(keys.run(self.run_id), "status", "finished")

    def close(self) -> None:
        """Whether the run finished, stopped or failed."""
        self.evaluator.cancel()  # one still running
        self.watch.close()
        self.sink.close()

    # --- one step ----------------------------------------------------------------------------

    def run_step(self) -> Metrics:
        """One optimizer step; returns its metrics (``self.step`` counts it by then)."""
        self.still_driving()
        self.after_outage()
        self.chosen = None
        t_step = time.monotonic()
        self.version = current_version(self.client)
        carried_in = self.carried
        # top up: groups past the age cap cancelled, every free slot filled
        self.collector.cancel_stale(self.step)
        self.collector.top_up(self.version)
        # wait, select
        batch = self._collect(carried_in)
        self.chosen = list(batch.group_ids)
        if batch.selection is not None:
            self.carried = batch.selection.new_carry_over_rollouts
        # train
        t_train = time.monotonic()
        trainer_metrics = self._train()
        t_end = time.monotonic()
        # record
        self._say_what_a_take_over_lost(trainer_metrics)
        counters = self.collector.counters()
        metrics = step_metrics(
            trainer_metrics, batch.selection, len(batch.group_ids), self.collector.n, counters,
            self.last_counters, waited=batch.waited, overdue=self.collector.age_wait_seconds,
            update_s=t_end - t_train, step_s=t_end - t_step,
            redis_used_memory=int(self.client.info("memory")["used_memory"]))
        self._record(metrics, counters)
        self._evaluate_between_steps()
        return metrics

    def _collect(self, carried_in: int) -> Batch:
        """The groups a dead driver selected for this step already, else the oldest
        complete ones, once enough are."""
        groups_key = keys.run_step_groups(self.run_id, self.step)
        if self.client.exists(groups_key):  # resumed after selecting, before the update ended
            return Batch(self.client.lrange(groups_key, 0, -1),
                         self.collector.selected(self.step), waited=0.0)  # figures as they were
        waited = self.collector.wait_ready(on_wait=self._while_waiting, step=self.step)
        selection = self.collector.select(self.step, carried_in, waited)
        return Batch(selection.group_ids, selection, waited)

    def _while_waiting(self) -> None:
        """Between the doorbell's rings, while the step waits for its groups."""
        self.still_driving()
        self.after_outage()
        # servers the keeper cannot restore: no group would finish without them
        if self.restore_servers() is not None:  # they serve a new version now
            self.version = current_version(self.client)
        self.collector.top_up(self.version)
        self.evaluator.feed()  # a periodic evaluation's next prompts, behind training's

    def _train(self) -> Metrics:
        """The step's update, in the trainer worker; its metrics."""
        try:
            return call_trainer(
                self.client, self.cfg, "workers.trainer.tasks.train_step", self.run_id,
                str(self.step), [self.run_id, self.step], while_running=self._while_training,
                outage=self.watch, after_outage=self.after_outage,
                if_lost=update_memory_knobs(self.cfg))
        except (Starved, TrainingFailed):
            raise  # the driver's own refill, not the trainer
        except TrainerLost as exc:  # the update killed every worker that took it up
            raise TrainingFailed(f"step {self.step}: {exc}") from exc
        except Exception as exc:
            raise TrainingFailed(f"update {self.step} failed in the trainer worker: "
                                 f"{exc.__class__.__name__}: {exc}") from exc

    def _while_training(self) -> None:
        """As the update is sent and at each poll of it. during_update: the freed slots work
        while the trainer does, on the old weights, so their age counts from this step like
        the rest of this step's dispatch. after_update: the next step's top-up starts them
        on the new ones (and the last step has no next one to refill for)."""
        if self.refill_during_update and self.step + 1 < self.total:
            self._refill()
        else:
            self.still_driving()
        self.evaluator.feed()

    def _refill(self) -> None:
        self.still_driving()
        # a slot freed once the step's weights are loaded starts on them: its age counts
        # from the next step, as after_update's refill does
        now = current_version(self.client)
        if now == self.version:
            # this step, or the next where its update is done already (a resumed step's:
            # its version was read after the update)
            self.collector.top_up(self.version)
        else:
            self.collector.top_up(now, dispatch_step=self.step + 1)

    def _say_what_a_take_over_lost(self, trainer_metrics: Mapping[str, object]) -> None:
        if not trainer_metrics.get("trainer/rolled_back_updates"):
            return
        since = trainer_metrics.get("trainer/restored_from_step")
        log.warning("update %d ran in a trainer worker that took the run up from %s: %d "
                    "update(s) since were lost (their weights and optimizer state; "
                    "trainer.save_freq %s)", self.step,
                    "the initial weights (no checkpoint yet)" if since is None
                    else f"the checkpoint of step {since}",
                    trainer_metrics["trainer/rolled_back_updates"], self.cfg.trainer.save_freq)

    def _record(self, metrics: Metrics, counters: dict[str, int]) -> None:
        """The step done: its counter, metrics entry and counters kept with the run (one
        transaction), then the metrics file, W&B and the console."""
        self.last_counters = counters
        self.step += 1
        self.still_driving()  # the step's counter and metrics are written by the lease's holder
        self.last_entry = {"step": self.step - 1, **metrics}
        self.collector.set_step(self.step, json.dumps(self.last_entry), counters)
        self.chosen = None
        self.sink.log(self.step - 1, metrics)
        if self.on_step:
            self.on_step(self.step - 1, metrics)
        elif self.console:
            print(console_line(self.step - 1, self.total, metrics), flush=True)

    def _evaluate_between_steps(self) -> None:
        """Evaluations run beside training (fed as their groups finish): reported between
        steps, never waited for."""
        self._report_eval(self.step - 1, self.evaluator.poll())
        if self.evaluator.due(self.step) and self.step < self.total:
            pending = self.evaluator.pending
            if pending is None:
                self.evaluator.start(self.step, current_version(self.client))
            else:
                log.warning("evaluation due after %d updates skipped: %s (sent after %d) is "
                            "still running", self.step, pending.eval_id, pending.step)

    def _report_eval(self, steps_done: int, val: dict[str, float] | None) -> None:
        if val is None:
            return
        pipe = self.client.pipeline()  # the report and its mark together: never one twice
        pipe.rpush(keys.run_metrics(self.run_id), json.dumps({"step": steps_done, **val}))
        pipe.hset(keys.run(self.run_id), RunRecord.field("evaluated_step"), steps_done)
        pipe.execute()
        self.sink.log(steps_done, val)
        if self.on_eval:
            self.on_eval(steps_done, val)
        elif self.console:
            print(val_line(steps_done, val), flush=True)

    # --- the lease and Redis outages ---------------------------------------------------------

    def still_driving(self) -> None:
        """Before anything that changes the run: the lease is still this driver's."""
        if self.lease.lost.is_set():
            raise TrainingFailed(f"run {self.run_id} was taken over by another driver; this "
                                 "one stops")

    def after_outage(self) -> None:
        """Redo what a Redis outage that ended since the last call may have lost of this
        driver's writes."""
        outage = self.watch.take()
        if outage is not None:
            repair(self.client, self.collector, self.run_id, outage, self.step, self.chosen,
                   self.last_entry, self.last_counters)

"""The asynchronous collector: keeps groups active, selects completed ones, carries the rest.

Invariants:
- All run state (active set, ready set, cursor, step, counters) is in Redis; a restarted
  driver reads it back and continues the same run with its carry-over intact.
- A group is selected for training only from ``run_ready``, which only the chord callback
  fills, and only after all ``n`` siblings finished: partial groups are never trained.
- Selection moves groups out of ``run_ready``/``run_active`` and into the step's list in one
  MULTI/EXEC: a group is consumed by exactly one step.
- Per-step bookkeeping touches only the groups dispatched, selected or cancelled in that
  step (plus O(1) reads), never the whole active set (``app.state.carry`` counts what is
  carried over).
- A group's age is ``step - dispatch_step``: the updates between the weights its rollouts
  started on and the update that consumes it. The age cap, the consumed ages and the
  carry-over age metric all use this one definition.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis
from celery import chord, group

from app.config.schema import Config
from app.driver.dataset import epoch_order, load_samples
from app.driver.selection import oldest_first
from app.state import carry, keys, retention
from app.state.completion import finish_group
from app.state.records import GroupRecord, RunRecord
from app.state.runs import MissingState, read_group, read_run

log = logging.getLogger(__name__)

# The rollout worker's tasks (workers/rollout/tasks.py), by name.
RUN_ROLLOUT = "workers.rollout.tasks.run_rollout"
FINISH_GROUP = "workers.rollout.tasks.finish_group"


class Starved(RuntimeError):
    """No step can be filled: dynamic sampling filtered the configured bound of groups, or
    every prompt is quarantined."""


@dataclass
class Selection:
    step: int
    group_ids: list[str]
    prev_carry_over_rollouts: int     # unfinished rollouts carried in from the previous step
    new_carry_over_rollouts: int      # unfinished rollouts carried into the next step
    carry_over_finished_rollouts: int  # finished siblings still active (not yet trainable or
    #                                   complete but not selected)
    complete_unselected_rollouts: int  # rollouts of complete groups left for a later step
    carry_over_age_max: int
    consumed_ages: list[int]
    wait_seconds: float


def training_active_groups(cfg: Config) -> int:
    """The groups training keeps in flight. Sync mode is the baseline: exactly one batch in
    flight, all of it waited for."""
    async_cfg = cfg.agentlightning.async_rollout
    return async_cfg.async_train_batch_size if async_cfg.enabled else cfg.data.train_batch_size


class Collector:
    def __init__(self, client: redis.Redis, run_id: str, cfg: Config, n: int | None = None,
                 samples: list[dict[str, object]] | None = None) -> None:
        self.r = client
        self.run_id = run_id
        self.cfg = cfg
        # ``n``: siblings per group when not the training ``rollout.n`` (an evaluation's)
        self.n = int(n if n is not None else cfg.actor_rollout_ref.rollout.n)
        self.train_batch = int(cfg.data.train_batch_size)
        async_cfg = cfg.agentlightning.async_rollout
        self.async_mode = bool(async_cfg.enabled)
        self.active_target = training_active_groups(cfg)
        self.max_age = async_cfg.max_carry_over_age_steps
        # cancel: a group past the cap is cancelled, its prompt re-queued; wait: the next
        # step trains it, waiting for it to complete (verl's max_off_policy_strategy wait)
        self.age_strategy = async_cfg.max_carry_over_age_strategy
        self.age_wait_seconds = 0.0  # the last wait's share spent on overdue groups
        filtering = cfg.algorithm.filter_groups
        self.filter_enabled = filtering.enable
        self.max_gen_batches = filtering.max_num_gen_batches
        # ``samples``: data.train_files as the driver already read it
        self.samples = samples if samples is not None else load_samples(cfg.data.train_files)
        self._next_reconcile: float | None = None  # wait_ready's next look for lost callbacks
        self._order_epoch = -1
        self._order: list[int] = []

    # --- run record ----------------------------------------------------------------

    @staticmethod
    def create_run(client: redis.Redis, run_id: str, cfg_plain: dict[str, object], mode: str,
                   temperature: float | None = None) -> RunRecord:
        rec = RunRecord(run_id=run_id, config=cfg_plain, mode=mode, created_at=time.time(),
                        temperature=temperature)
        if not client.hsetnx(keys.run(run_id), "run_id", run_id):
            raise ValueError(f"run {run_id!r} already exists; use --resume {run_id}")
        client.hset(keys.run(run_id), mapping=rec.to_hash())
        return rec

    def run(self) -> RunRecord:
        return read_run(self.r, self.run_id)

    COUNTERS = ("dropped", "cancelled", "dispatched", "filtered", "quarantined", "requeued")

    def counters(self) -> dict[str, int]:
        raw = self.r.hmget(keys.run(self.run_id),
                           *[RunRecord.field("n_" + name) for name in self.COUNTERS])
        return {name: int(v or 0) for name, v in zip(self.COUNTERS, raw, strict=True)}

    # --- dispatch ------------------------------------------------------------------

    def _next_sample_index(self, run: RunRecord) -> tuple[int, bool]:
        """The next prompt, and whether it is the head of the re-queue: then the dispatch's
        own transaction pops it, so a driver that dies in between loses no prompt."""
        quarantined = self.r.hkeys(keys.run_quarantined(self.run_id))
        while (requeued := self.r.lindex(keys.run_requeue(self.run_id), 0)) is not None:
            if requeued not in quarantined:
                return int(requeued), True
            self.r.lpop(keys.run_requeue(self.run_id))  # re-queued before its quarantine
        if len(quarantined) >= len(self.samples):
            raise Starved(f"every one of the {len(self.samples)} prompts is quarantined "
                          "(data.max_prompt_failures): the agent fails on all of them")
        while True:  # a later epoch skips the prompts quarantined (data.max_prompt_failures)
            if self._order_epoch != run.epoch:
                self._order = epoch_order(len(self.samples), int(self.cfg.data.seed),
                                          run.epoch, bool(self.cfg.data.shuffle))
                self._order_epoch = run.epoch
            index = self._order[run.cursor]
            run.cursor += 1
            if run.cursor >= len(self._order):
                run.cursor, run.epoch = 0, run.epoch + 1
            if str(index) not in quarantined:
                return index, False

    def top_up(self, policy_version: int, dispatch_step: int | None = None,
               at_most: int | None = None) -> int:
        """Dispatch new groups until ``active_target`` are active, and at most ``at_most``;
        returns how many. ``dispatch_step``: the step the groups are dispatched for (default:
        the run's step, or the next one once its update is done)."""
        active = self.r.zcard(keys.run_active(self.run_id))
        run = self.run()
        if dispatch_step is None:
            # the run's step; the next one where its update is done but not yet recorded
            # (a driver that died in between): the groups start on that update's weights
            dispatch_step = run.step + bool(
                self.r.exists(keys.run_step_result(self.run_id, run.step)))
        sent = 0
        while active + sent < self.active_target and (at_most is None or sent < at_most):
            index, requeued = self._next_sample_index(run)
            seq = run.next_seq
            run.next_seq += 1
            gid = f"{self.run_id}-g{seq}"
            rec = GroupRecord(group_id=gid, run_id=self.run_id, sample_index=index,
                              sample=self.samples[index], n=self.n, seq=seq,
                              dispatch_step=dispatch_step, dispatch_version=policy_version,
                              dispatched_at=time.time())
            pipe = self.r.pipeline(transaction=True)
            if requeued:  # the head read above: one driver per run, and others only append
                pipe.lpop(keys.run_requeue(self.run_id))
            pipe.hset(keys.group(gid), mapping=rec.to_hash())
            pipe.zadd(keys.run_active(self.run_id), {gid: seq})
            pipe.hset(keys.run(self.run_id), mapping={
                "cursor": run.cursor, "epoch": run.epoch, "next_seq": run.next_seq})
            pipe.hincrby(keys.run(self.run_id), RunRecord.field("n_dispatched"), 1)
            pipe.execute()
            self._send(gid)
            sent += 1
        return sent

    def _send(self, group_id: str) -> None:
        from app.celery_app import celery_app

        # Signatures by task name: the driver (app/) never imports the workers' code.
        siblings = group(celery_app.signature(RUN_ROLLOUT, args=(group_id, i))
                         for i in range(self.n))
        result = chord(siblings)(celery_app.signature(FINISH_GROUP, args=(group_id,)))
        sibling_ids = [r.id for r in result.parent.results] if result.parent else []
        # Marked after sending: on resume, groups without the mark are sent again.
        self.r.hset(keys.group(group_id), mapping={
            GroupRecord.field("sent"): "1", GroupRecord.field("task_ids"): json.dumps(sibling_ids),
            GroupRecord.field("callback_id"): result.id})

    def resend_unsent(self) -> int:
        """After a driver crash between recording a group and sending its chord."""
        resent = 0
        for gid in self.r.zrange(keys.run_active(self.run_id), 0, -1):
            if self.r.hget(keys.group(gid), GroupRecord.field("sent")) != "1":
                self._send(gid)
                resent += 1
        return resent

    # --- staleness -----------------------------------------------------------------

    def cancel_stale(self, step: int) -> int:
        """Cancel active groups dispatched more than ``max_carry_over_age_steps`` ago and
        re-queue their prompts. Oldest first, stopping at the first young group. (With the
        ``wait`` strategy nothing is cancelled: see ``overdue``.)"""
        if self.max_age is None or self.age_strategy == "wait":
            return 0
        cancelled = 0
        while True:
            oldest = self.r.zrange(keys.run_active(self.run_id), 0, 0)
            if not oldest:
                return cancelled
            rec = read_group(self.r, oldest[0])
            if step - rec.dispatch_step <= int(self.max_age):  # the age (module docstring)
                return cancelled
            if not self._cancel(rec):
                continue  # left the active set meanwhile
            cancelled += 1
            log.info("group %s cancelled: age %d > max_carry_over_age_steps %s; prompt re-queued",
                     rec.group_id, step - rec.dispatch_step, self.max_age)

    def overdue(self, step: int) -> list[str]:
        """``wait`` strategy: the active groups older than the cap at ``step``, oldest first
        and at most a batch of them. They have the lowest dispatch sequence numbers, so once
        complete the oldest-first selection takes them; the step waits for that."""
        if self.max_age is None or self.age_strategy != "wait":
            return []
        out = []
        for gid in self.r.zrange(keys.run_active(self.run_id), 0, self.train_batch - 1):
            dispatched = self.r.hget(keys.group(gid), GroupRecord.field("dispatch_step"))
            if dispatched is None or step - int(dispatched) <= int(self.max_age):
                break
            out.append(gid)
        return out

    def cancel_all(self) -> int:
        """Cancel every active group (a finished run's carry-over): their agents stop, their
        data expires, and their prompts are re-queued (a resumed run sends them again)."""
        cancelled = 0
        for gid in self.r.zrange(keys.run_active(self.run_id), 0, -1):
            try:
                cancelled += self._cancel(read_group(self.r, gid))
            except MissingState:
                continue
        if cancelled:
            log.info("run %s: %d carried-over group(s) cancelled at its end", self.run_id,
                     cancelled)
        return cancelled

    def _cancel(self, rec: GroupRecord) -> bool:
        """Cancel one active group; False when it left the active set meanwhile."""
        if not carry.cancel_group(self.r, self.run_id, rec.group_id, rec.sample_index):
            return False
        retention.expire_untrained(self.r, rec.group_id)
        self.revoke(rec.group_id)
        return True

    def revoke(self, group_id: str) -> None:
        """Siblings still queued are dropped by their workers; running ones see the group's
        ``cancelled`` status and stop their agents (process groups are killed)."""
        from app.celery_app import celery_app

        ids = json.loads(self.r.hget(keys.group(group_id), GroupRecord.field("task_ids"))
                         or "[]")
        if ids:
            celery_app.control.revoke(ids)

    # --- selection -----------------------------------------------------------------

    def wait_ready(self, poll_s: float = 1.0, should_stop: Callable[[], bool] = lambda: False,
                   on_wait: Callable[[], object] = lambda: None,
                   reconcile_every_s: float = 15.0,
                   report_every_s: float = 30.0, step: int | None = None) -> float:
        """Block (on the callback's doorbell, no polling of rollouts) until enough groups
        are complete, and (``wait`` age strategy, given ``step``) every overdue group too;
        returns the seconds waited (``age_wait_seconds``: the part spent on overdue groups
        alone). A long wait triggers a reconcile, and, while groups are being filtered, a
        log line with the figures; past ``filter_groups.max_num_gen_batches`` batches'
        worth of filtered groups it raises ``Starved``."""
        started = time.monotonic()
        if self._next_reconcile is None:
            self._next_reconcile = started + reconcile_every_s
        next_report = started + report_every_s
        filtered_before = self.counters()["filtered"]
        held_at: float | None = None  # when enough groups were ready but overdue ones not
        while True:
            # Counted across waits: in async mode other groups fill each batch, so a group
            # whose callback never ran would not make any one wait long, and would hold its
            # slot for good (or be cancelled at its age cap, complete as it is).
            if time.monotonic() > self._next_reconcile:
                self.reconcile()
                self._next_reconcile = time.monotonic() + reconcile_every_s
            ready = self.r.zcard(keys.run_ready(self.run_id))
            if ready >= self.train_batch:
                if step is None or not self._overdue_unfinished(step):
                    break
                held_at = held_at or time.monotonic()
            if should_stop():
                break
            self.r.blpop([keys.run_wakeup(self.run_id)], timeout=poll_s)
            on_wait()
            now = time.monotonic()
            if self.filter_enabled and (now > next_report or self.max_gen_batches):
                filtered = self.counters()["filtered"] - filtered_before
                self._check_starved(filtered, ready, now - started, now > next_report)
                if now > next_report:
                    next_report = now + report_every_s
        end = time.monotonic()
        self.age_wait_seconds = end - held_at if held_at is not None else 0.0
        return end - started

    def _overdue_unfinished(self, step: int) -> bool:
        ready_key = keys.run_ready(self.run_id)
        return any(self.r.zscore(ready_key, gid) is None for gid in self.overdue(step))

    def _check_starved(self, filtered: int, ready: int, waited: float, report: bool) -> None:
        limit = self.max_gen_batches * self.train_batch
        figures = (f"{ready} of {self.train_batch} informative groups ready after "
                   f"{waited:.0f} s; {filtered} complete groups filtered meanwhile (all "
                   f"rewards equal), {self.active_count()} active")
        if limit and filtered >= limit:
            raise Starved(f"dynamic sampling starved the step: {figures}; stopped at "
                          f"algorithm.filter_groups.max_num_gen_batches="
                          f"{self.max_gen_batches} ({limit} groups)")
        if report and filtered:
            log.warning("waiting for informative groups: %s", figures)

    def reconcile(self) -> int:
        """Complete groups whose siblings all finished but whose chord callback never ran
        (a chord errors when storing a sibling's result fails). Completion is idempotent,
        so racing a late callback is harmless. O(active groups): only run on long waits."""
        fixed = 0
        for gid in self.r.zrange(keys.run_active(self.run_id), 0, -1):
            if self.r.exists(keys.group_done(gid)):
                continue
            if self.r.hlen(keys.group_results(gid)) >= self.n:
                if finish_group(self.r, gid) in ("complete", "dropped", "filtered"):
                    fixed += 1
                    log.warning("group %s completed by the driver: its chord callback did "
                                "not run", gid)
        return fixed

    def select(self, step: int, prev_carry_over_rollouts: int, wait_seconds: float
               ) -> Selection:
        ready_key = keys.run_ready(self.run_id)
        active_key = keys.run_active(self.run_id)
        chosen = oldest_first(self.r.zrange(ready_key, 0, -1, withscores=True),
                              self.train_batch)
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(ready_key, *chosen)
        pipe.zrem(active_key, *chosen)
        pipe.delete(keys.run_step_groups(self.run_id, step))
        pipe.rpush(keys.run_step_groups(self.run_id, step), *chosen)
        now = str(time.time())
        for gid in chosen:
            pipe.hset(keys.group(gid), mapping={GroupRecord.field("status"): "selected",
                                                GroupRecord.field("selected_at"): now})
        # complete groups hold all n results, each counted while the group was active
        pipe.hincrby(keys.run(self.run_id), carry.FIELD, -len(chosen) * self.n)
        pipe.execute()
        return self._figures(step, list(chosen), prev_carry_over_rollouts, wait_seconds)

    def _figures(self, step: int, chosen: list[str], prev_carry_over_rollouts: int,
                 wait_seconds: float) -> Selection:
        """The selection's figures, read after it, and recorded with the run."""
        dispatch_steps = [int(s) for s in (self.r.hget(keys.group(g), "dispatch_step")
                                           for g in chosen)]
        unfinished, finished, complete = carry.carried(self.r, self.run_id, self.n)
        oldest = self.r.zrange(keys.run_active(self.run_id), 0, 0)
        age_max = (step - int(self.r.hget(keys.group(oldest[0]), "dispatch_step"))
                   if oldest else 0)
        selection = Selection(step=step, group_ids=chosen,
                              prev_carry_over_rollouts=prev_carry_over_rollouts,
                              new_carry_over_rollouts=unfinished,
                              carry_over_finished_rollouts=finished,
                              complete_unselected_rollouts=complete,
                              carry_over_age_max=age_max,
                              consumed_ages=[step - d for d in dispatch_steps],
                              wait_seconds=wait_seconds)
        self.r.hset(keys.run(self.run_id), mapping={
            RunRecord.field("carry_unfinished"): unfinished,
            RunRecord.field("last_selection"): json.dumps(asdict(selection))})
        return selection

    def selected(self, step: int) -> Selection | None:
        """The selection of ``step`` as it was made (a driver resumed after selecting, before
        the update ended). One whose figures were not recorded (the driver died right after
        the selection) has them read now, as near as they can be (the carry-over may have
        moved on since); None if ``step`` selected nothing yet."""
        raw = self.r.hget(keys.run(self.run_id), RunRecord.field("last_selection"))
        recorded = json.loads(raw) if raw else {}
        if recorded.get("step") == step:
            return Selection(**recorded)
        chosen = self.r.lrange(keys.run_step_groups(self.run_id, step), 0, -1)
        if not chosen:
            return None
        log.warning("step %d: its selection's figures were not recorded (the driver died "
                    "right after it); read again now", step)
        return self._figures(step, chosen, self.carried_in(), 0.0)

    def carried_in(self) -> int:
        """Unfinished rollouts the last selection carried over (0 for a new run)."""
        return int(self.r.hget(keys.run(self.run_id), RunRecord.field("carry_unfinished"))
                   or 0)

    def active_count(self) -> int:
        return self.r.zcard(keys.run_active(self.run_id))

    def set_step(self, step: int, metrics_entry: str | None = None,
                 counted: dict[str, int] | None = None) -> None:
        """Record ``step`` updates done, with the last one's metrics entry and the counters
        it counted up to, in the same transaction: a driver killed between them would
        resume past a step whose metrics were never kept."""
        pipe = self.r.pipeline()
        pipe.hset(keys.run(self.run_id), RunRecord.field("step"), step)
        if metrics_entry is not None:
            pipe.rpush(keys.run_metrics(self.run_id), metrics_entry)
        if counted is not None:
            pipe.hset(keys.run(self.run_id), RunRecord.field("counted"), json.dumps(counted))
        pipe.execute()

"""Evaluation during training, as verl users know it: ``data.val_files`` held out,
``trainer.val_before_train``, ``trainer.test_freq`` and the sampling of
``actor_rollout_ref.rollout.val_kwargs``.

An evaluation is a run of its own in Redis (``<run>-val<step>``, mode ``eval``): its groups
go through the same chords, rollout workers, controller and gateway as training groups, but
they live in that run's active and ready sets, so the training run's selection, carry-over
counts and trainer never see them, and nothing of them is trained. The gateway samples their
calls at the evaluation temperature (greedy unless ``do_sample``).

Scheduling: the evaluation before training is waited for (it measures the initial policy
alone), and all its prompts are sent at once. A periodic one is sent at its step and runs
beside training without stalling it: it keeps at most ``trainer.val_active_groups`` groups
in flight (by default as many rollouts as training keeps), the next prompt sent as one
finishes, so that a large held-out set never holds training's refills behind all of its
rollouts in the one rollout queue. It is reported at the first step boundary after its last
group finished. Weight loads can happen while it runs, so each report names the policy
versions that served its calls (``val/policy_version_min`` and ``_max``). The last one is
waited for before the run ends, with what is left of it sent at once.
"""

from __future__ import annotations

import logging
import re
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from app.config.schema import Config
from app.driver.collector import Collector, training_active_groups
from app.state import carry, keys, retention
from app.state.completion import sibling_results
from app.state.policy import current_version
from app.state.records import SUCCESS_REWARD, CapturedCall, GroupRecord, RunRecord
from app.state.runs import MissingState, read_run, run_config

log = logging.getLogger(__name__)

EVAL_MODE = "eval"


def eval_temperature(cfg: Config) -> float:
    """The temperature evaluation calls are sampled at (0: greedy)."""
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    return float(val.temperature) if val.do_sample else 0.0


def eval_config(cfg: Config, n_samples: int) -> dict[str, object]:
    """The training config turned into an evaluation's: the held-out prompts in file order,
    each dispatched once, failures counted as reward 0. (The group size, ``val_kwargs.n``, is
    the collector's: ``rollout.n`` stays the training one, which its rules hold to.)"""
    plain = cfg.to_dict()
    plain["data"].update(train_files=plain["data"]["val_files"], shuffle=False,
                         train_batch_size=n_samples)
    # nothing of it is trained; a mini-batch larger than the held-out set would fail the
    # batch rules each time the workers read this config back
    plain["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 0
    plain["agentlightning"]["async_rollout"]["enabled"] = False
    plain["controller"]["on_failure"] = "zero_reward"
    plain["algorithm"]["filter_groups"]["enable"] = False  # every prompt is measured
    return plain


@dataclass
class PendingEval:
    eval_id: str
    step: int            # optimizer steps done when it was sent
    version: int         # the policy version when it was sent
    started: float
    n_groups: int        # one per held-out prompt: sent at once or as others finish
    collector: Collector
    # the last time a group of it finished, and how many had: the timeout counts from there
    progress_at: float = 0.0
    done: int = 0


class Evaluator:
    def __init__(self, client: redis.Redis, run_id: str, cfg: Config) -> None:
        from app.driver.dataset import load_samples

        self.r = client
        self.run_id = run_id
        self.cfg = cfg
        self.files = cfg.data.val_files
        self.freq = int(cfg.trainer.test_freq)
        # longest an evaluation may go without a group finishing: every attempt of its slowest
        # rollout, and a minute (counted from its last progress, not its start: a large set
        # runs in rounds of the free rollout slots, and waits out the weight loads)
        self.timeout_s = float(cfg.controller.rollout_timeout_s) * \
            int(cfg.controller.max_attempts) + 60.0
        self.keep_s = float(cfg.trainer.trained_data_ttl_s)
        # by default as many rollouts in flight as training keeps, in the evaluation's groups
        rollout = cfg.actor_rollout_ref.rollout
        self.max_active = int(cfg.trainer.val_active_groups or -(
            -training_active_groups(cfg) * int(rollout.n) // int(rollout.val_kwargs.n)))
        self.pending: PendingEval | None = None
        # read at start, so that a bad file fails the run before training, under its own key
        self.samples = load_samples(self.files, key="data.val_files") if self.files else []
        self.n_samples = len(self.samples)

    @property
    def enabled(self) -> bool:
        return bool(self.files)

    def before_training(self) -> bool:
        return self.enabled and bool(self.cfg.trainer.val_before_train)

    def due(self, steps_done: int) -> bool:
        """An evaluation is due after ``steps_done`` updates (every ``test_freq``)."""
        return self.enabled and self.freq > 0 and steps_done > 0 and steps_done % self.freq == 0

    def start(self, steps_done: int, version: int) -> PendingEval:
        # a fresh id per evaluation: a resumed driver never meets the groups of one it lost
        eval_id = f"{self.run_id}-val{steps_done}-{secrets.token_hex(2)}"
        plain = eval_config(self.cfg, self.n_samples)
        Collector.create_run(self.r, eval_id, plain, EVAL_MODE, eval_temperature(self.cfg))
        n_val = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
        collector = Collector(self.r, eval_id, Config.of(plain), n=n_val,
                              samples=self.samples)
        now = time.monotonic()
        self.pending = PendingEval(eval_id, steps_done, version, now, self.n_samples,
                                   collector, progress_at=now)
        sent = self.feed()
        log.info("evaluation %s: %d held-out prompts x %d, %d of them sent now (policy "
                 "version %d)", eval_id, self.n_samples, n_val, sent, version)
        return self.pending

    def feed(self, all_at_once: bool = False) -> int:
        """Send more of the pending evaluation's prompts: until ``max_active`` of its groups
        are in flight, or every prompt left (``all_at_once``: nothing trains beside it);
        -> how many. Each prompt is sent once: a dropped one counts as a failure."""
        pending = self.pending
        if pending is None:
            return 0
        pipe = self.r.pipeline(transaction=True)
        pipe.hget(keys.run(pending.eval_id), RunRecord.field("n_dispatched"))
        pipe.zcard(keys.run_active(pending.eval_id))
        pipe.zcard(keys.run_ready(pending.eval_id))
        sent, active, ready = pipe.execute()
        left = self.n_samples - int(sent or 0)
        if left <= 0:
            return 0
        # a finished group stays in the active set (nothing selects an evaluation's groups
        # out of it): in flight are the active ones not ready
        room = left if all_at_once else min(left, self.max_active - (active - ready))
        if room <= 0:
            return 0
        # a dropped group's prompt is re-queued: an evaluation counts it failed instead
        self.r.delete(keys.run_requeue(pending.eval_id))
        pending.collector.active_target = active + room
        try:
            return pending.collector.top_up(current_version(self.r),
                                            dispatch_step=pending.step, at_most=room)
        except MissingState:  # its run record is gone (a Redis outage lost the writes)
            log.warning("evaluation %s: its records are gone; cancelled, not reported",
                        pending.eval_id)
            self.cancel()
            return 0

    def adopt(self, version: int) -> PendingEval | None:
        """At resume: the evaluation the dead driver left running is taken up and reported
        as any other (its rollouts went on meanwhile); left alone, it would hold rollout
        slots and never expire. At most one runs at a time: an older one is cancelled.
        ``version``: the policy version now, for a report none of whose calls were
        captured."""
        # this run's evaluations only (not a run named <run_id>-valid's), whatever the id holds
        mine = re.compile(re.escape(self.run_id) + r"-val(\d+)-[0-9a-f]+")
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", keys.run(f"{self.run_id}-val")) + "*"
        found: list[tuple[RunRecord, int]] = []  # with the updates done when it was sent
        for key in self.r.scan_iter(pattern):
            eval_id = key.removeprefix(keys.run(""))
            match = mine.fullmatch(eval_id)
            if not match:  # one of its sets, or another run's
                continue
            try:
                rec = read_run(self.r, eval_id)
            except MissingState:  # expired since the scan
                continue
            if rec.mode == EVAL_MODE and rec.status == "running":
                found.append((rec, int(match.group(1))))
        found.sort(key=lambda item: item[0].created_at)
        for rec, sent_at in found:
            if self.pending is not None:
                log.warning("evaluation %s: an older one still running; cancelled",
                            self.pending.eval_id)
                self.cancel()
            n_val = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
            collector = Collector(self.r, rec.run_id, run_config(self.r, rec.run_id), n=n_val,
                                  samples=self.samples)
            collector.resend_unsent()
            # how long it has run, on this process's clock
            started = time.monotonic() - max(time.time() - rec.created_at, 0.0)
            # every group it sent is waited for (more than the file holds now, if the file
            # changed since it was sent)
            self.pending = PendingEval(rec.run_id, sent_at, version, started,
                                       max(self.n_samples, rec.n_dispatched), collector,
                                       progress_at=time.monotonic())
            # the prompts not sent yet (or never: the dead driver died sending them)
            self.feed()
            log.info("evaluation %s (sent after %d updates) taken up from the driver before",
                     rec.run_id, sent_at)
        return self.pending

    def finished(self, pending: PendingEval) -> bool:
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(keys.run_ready(pending.eval_id))
        pipe.hget(keys.run(pending.eval_id), RunRecord.field("n_dropped"))
        ready, dropped = pipe.execute()
        done = int(ready) + int(dropped or 0)
        if done > pending.done:
            pending.done, pending.progress_at = done, time.monotonic()
        return done >= pending.n_groups

    def poll(self) -> dict[str, float] | None:
        """The pending evaluation's metrics once its last group finished, else None. One that
        outlived ``timeout_s`` is cancelled and not reported."""
        pending = self.pending
        if pending is None:
            return None
        pending.collector.reconcile()  # a group whose chord callback never ran (30 reads)
        self.feed()
        if self.pending is None:  # cancelled: its records are gone
            return None
        if self.finished(pending):
            return self._report()
        if time.monotonic() - pending.progress_at > self.timeout_s:
            log.warning("evaluation %s: no group finished for %.0f s (%d of %d done); "
                        "cancelled, not reported", pending.eval_id, self.timeout_s,
                        pending.done, pending.n_groups)
            self.cancel()
        return None

    def wait(self, poll_s: float = 0.5, on_wait: Callable[[], object] = lambda: None
             ) -> dict[str, float] | None:
        """Block until the pending evaluation finished (or was cancelled); its metrics.
        ``on_wait`` runs between polls (the driver's restore of servers that lost the
        weights: the evaluation's rollouts need them too)."""
        reconcile_at = time.monotonic() + 15.0
        self.feed(all_at_once=True)  # nothing trains meanwhile
        while self.pending is not None:
            on_wait()
            if self.finished(self.pending):
                return self._report()
            if time.monotonic() > reconcile_at:
                reconcile_at = time.monotonic() + 15.0
                if (metrics := self.poll()) is not None:
                    return metrics
                continue
            self.r.blpop([keys.run_wakeup(self.pending.eval_id)], timeout=poll_s)
        return None

    def cancel(self) -> None:
        """Stop the pending evaluation: its queued rollouts are revoked, running agents see
        their group cancelled, and what it captured is released."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        for gid in self.r.zrange(keys.run_active(pending.eval_id), 0, -1):
            index = self.r.hget(keys.group(gid), GroupRecord.field("sample_index"))
            if carry.cancel_group(self.r, pending.eval_id, gid, int(index or 0)):
                pending.collector.revoke(gid)
        self._release(pending.eval_id)

    def _report(self) -> dict[str, float]:
        pending = self.pending
        assert pending is not None
        rewards: list[float] = []
        versions: list[int] = []
        failed = 0
        group_ids = self.r.zrange(keys.run_ready(pending.eval_id), 0, -1)
        for gid in group_ids:
            for result in sibling_results(self.r, gid).values():
                if result.status == "ok" and result.reward is not None:
                    rewards.append(float(result.reward))
                else:
                    rewards.append(0.0)
                    failed += 1
                if result.rollout_id:
                    for raw in self.r.lrange(keys.rollout_calls(result.rollout_id), 0, -1):
                        call = CapturedCall.from_json(raw)
                        versions.append(call.policy_version)
                        if call.policy_version_end is not None:
                            versions.append(call.policy_version_end)
        self._release(pending.eval_id, group_ids)
        self.pending = None
        metrics = {
            "val/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "val/success_rate": (sum(r >= SUCCESS_REWARD for r in rewards) / len(rewards)
                                 if rewards else 0.0),
            "val/n_prompts": float(len(group_ids)),
            "val/n_rollouts": float(len(rewards)),
            "val/n_failed_rollouts": float(failed),
            "val/policy_version_min": float(min(versions, default=pending.version)),
            "val/policy_version_max": float(max(versions, default=pending.version)),
            "val/sent_at_step": float(pending.step),
            "val/seconds": time.monotonic() - pending.started,
        }
        log.info("evaluation %s: success %.3f, reward %.3f over %d rollouts (policy versions "
                 "%d-%d, %.0f s)", pending.eval_id, metrics["val/success_rate"],
                 metrics["val/reward_mean"], len(rewards), metrics["val/policy_version_min"],
                 metrics["val/policy_version_max"], metrics["val/seconds"])
        return metrics

    def _release(self, eval_id: str, group_ids: list[str] | None = None) -> None:
        """An evaluation's captured calls are never trained: drop them once read, and let the
        rest of it expire as a trained group's record does."""
        if group_ids is None:
            group_ids = self.r.zrange(keys.run_active(eval_id), 0, -1) + \
                self.r.zrange(keys.run_ready(eval_id), 0, -1)
        if group_ids:
            retention.release_trained(self.r, list(group_ids), self.keep_s)
        self.r.hset(keys.run(eval_id), RunRecord.field("status"), "finished")
        ttl = max(int(self.keep_s), 1)
        pipe = self.r.pipeline(transaction=False)
        for key in (keys.run(eval_id), keys.run_active(eval_id), keys.run_ready(eval_id),
                    keys.run_wakeup(eval_id), keys.run_requeue(eval_id)):
            pipe.expire(key, ttl)
        pipe.execute()

"""What the driver redoes after a Redis outage.

With ``appendfsync everysec`` a crashed Redis comes back from its AOF without up to about a
second of writes it had acknowledged (a machine crash, or a disk slow enough that Redis
postponed its writes; a killed ``redis-server`` process alone loses nothing the kernel
already has). The AOF is a log, so what is lost is always a suffix: everything after some
moment, never a write in the middle. For the driver's own writes in a step's critical path:

- a group's completion mark (the chord callback's script): the group is still active with
  all its sibling results; ``Collector.reconcile`` completes it again from them, right
  after the outage instead of after a long wait;
- the step's selection: the driver still holds the groups it chose; the selection is
  written again, the same groups (the trainer's per-group trained marks keep each group in
  exactly one step), and the trainer task, sent after it and so lost with it, is sent again
  (trainer tasks are idempotent: a copy that already ran answers from the stored result);
- the step counter and the step's metrics entry: written again from the driver's memory.
- a group's chord (sent after its record, and marked ``sent`` after that): a group whose
  record survived without the mark is sent again, as on resume (a sibling that survived
  twice runs twice, which siblings tolerate).

Each repair is logged, so the run's log says what the outage cost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import redis

from app.state import carry, keys
from app.state.connection import outage_for
from app.state.records import GroupRecord, RunRecord

if TYPE_CHECKING:
    from app.driver.collector import Collector

log = logging.getLogger(__name__)


class OutageWatch:
    """Hears the end of each Redis outage this process's clients rode out."""

    def __init__(self, url: str) -> None:
        self._outage = outage_for(url)
        self._ended = threading.Event()
        self.last: tuple[float, float] = (0.0, 0.0)
        self._outage.listeners.append(self._on_end)

    def _on_end(self, began: float, ended: float) -> None:
        self.last = (began, ended)
        self._ended.set()

    def pending(self) -> bool:
        return self._ended.is_set()

    def take(self) -> tuple[float, float] | None:
        """The outage that ended since the last call (began, ended), or None."""
        if not self._ended.is_set():
            return None
        self._ended.clear()
        return self.last

    def close(self) -> None:
        if self._on_end in self._outage.listeners:
            self._outage.listeners.remove(self._on_end)


def reassert_selection(client: redis.Redis, run_id: str, step: int, chosen: list[str],
                       n: int) -> bool:
    """Write ``step``'s selection of ``chosen`` again if Redis lost it; True if it did.
    The same transaction as ``Collector.select``: the groups leave the ready and active
    sets and the carry count drops by their rollouts (lost with the selection, so counted
    again exactly once)."""
    if not chosen or client.exists(keys.run_step_groups(run_id, step)):
        return False
    # a group the outage took a sibling result from is no longer complete: never trained
    # partial, it stays active (the selection goes on with the rest)
    pipe = client.pipeline(transaction=False)
    for gid in chosen:
        pipe.hlen(keys.group_results(gid))
    counts = pipe.execute()
    partial = [gid for gid, c in zip(chosen, counts, strict=True) if int(c) < n]
    if partial:
        log.warning("step %d: %d selected group(s) lost a sibling result in the Redis outage "
                    "and stay active, not trained partial: %s", step, len(partial),
                    ", ".join(partial))
    chosen = [gid for gid in chosen if gid not in partial]
    if not chosen:
        return False
    pipe = client.pipeline(transaction=True)
    pipe.zrem(keys.run_ready(run_id), *chosen)
    pipe.zrem(keys.run_active(run_id), *chosen)
    pipe.rpush(keys.run_step_groups(run_id, step), *chosen)
    now = str(time.time())
    for gid in chosen:
        pipe.hset(keys.group(gid), mapping={GroupRecord.field("status"): "selected",
                                            GroupRecord.field("selected_at"): now})
    pipe.hincrby(keys.run(run_id), carry.FIELD, -len(chosen) * n)
    pipe.execute()
    return True


def repair(client: redis.Redis, collector: Collector, run_id: str,
           outage: tuple[float, float], step: int, chosen: list[str] | None,
           last_metrics: Mapping[str, object] | None,
           counted: dict[str, int] | None = None) -> dict[str, int]:
    """Redo what the outage may have lost of the driver's writes (the module docstring);
    ``step`` is the step in progress, ``chosen`` its selection if made, ``last_metrics``
    the previous step's metrics entry and ``counted`` the counters it counted up to (kept
    with the step counter). Returns what was redone, and logs it."""
    began, ended = outage
    redone = {"completed_again": collector.reconcile(), "resent": collector.resend_unsent(),
              "selection": 0, "step_counter": 0, "metrics_entry": 0}
    if chosen is not None and reassert_selection(client, run_id, step, chosen, collector.n):
        redone["selection"] = 1
    if int(client.hget(keys.run(run_id), RunRecord.field("step")) or 0) < step:
        collector.set_step(step, counted=counted)
        redone["step_counter"] = 1
    if last_metrics is not None:
        entries = client.lrange(keys.run_metrics(run_id), -3, -1)
        if not any(json.loads(e).get("step") == last_metrics["step"]
                   and "timing/step_seconds" in json.loads(e) for e in entries):
            client.rpush(keys.run_metrics(run_id), json.dumps(last_metrics))
            redone["metrics_entry"] = 1
    done = ", ".join(f"{what} {count}" for what, count in redone.items() if count) or "nothing"
    what = (f"unreachable for {ended - began:.1f} s" if ended > began
            else "restarted (no command of the driver waited through it)")
    log.warning("Redis was %s during step %d; checked what it may have lost: redone %s",
                what, step, done)
    return redone

"""Group completion: the chord callback's work.

Invariant: a group becomes complete (or dropped) exactly once. The ``group_done`` key is
taken with SET NX before anything else is written, so a callback that runs twice (a
redelivered message, a retried chord) finds it taken and changes nothing.
"""

from __future__ import annotations

import logging
import time

import redis

from app.state import keys
from app.state.records import SiblingResult
from app.state.runs import read_group, run_config

log = logging.getLogger(__name__)


def sibling_results(client: redis.Redis, group_id: str) -> dict[int, SiblingResult]:
    raw = client.hgetall(keys.group_results(group_id))
    return {int(k): SiblingResult.from_json(v) for k, v in raw.items()}


def finish_group(client: redis.Redis, group_id: str) -> str:
    group = read_group(client, group_id)
    results = sibling_results(client, group_id)
    if len(results) < group.n:
        # Only a chord that fired early could get here (a sibling that ran twice: a worker
        # wrongly presumed dead). Never mark a partial group; flag it so the last sibling
        # to store its result finishes it (flag first, then look again: one of the two
        # sides always sees the other).
        client.hset(keys.group(group_id), "callback_early", "1")
        results = sibling_results(client, group_id)
        if len(results) < group.n:
            log.warning("group %s: callback saw %d of %d siblings; the last sibling will "
                        "complete it", group_id, len(results), group.n)
            return "incomplete"
    if not client.set(keys.group_done(group_id), "1", nx=True):
        log.info("group %s: completion already recorded (duplicate callback)", group_id)
        return "duplicate"
    if group.status == "cancelled":
        return "cancelled"
    cfg = run_config(client, group.run_id)
    failed = [r for r in results.values() if r.status != "ok"]
    pipe = client.pipeline(transaction=True)
    if failed and cfg.controller.on_failure == "requeue":
        outcome = "dropped"
        pipe.hset(keys.group(group_id), mapping={"status": "dropped",
                                                 "completed_at": str(time.time())})
        pipe.zrem(keys.run_active(group.run_id), group_id)
        pipe.rpush(keys.run_requeue(group.run_id), group.sample_index)
        pipe.hincrby(keys.run(group.run_id), "n_dropped", 1)
        log.warning("group %s dropped and its prompt re-queued: %d sibling(s) failed (%s)",
                    group_id, len(failed), failed[0].error)
    else:
        outcome = "complete"
        pipe.hset(keys.group(group_id), mapping={"status": "complete",
                                                 "completed_at": str(time.time())})
        pipe.zadd(keys.run_ready(group.run_id), {group_id: group.seq})
    pipe.rpush(keys.run_wakeup(group.run_id), group_id)
    pipe.execute()
    return outcome

"""A trained group's captured data is released once its step is stored: calls, rollout
records and Celery's copies of its results go at once, its record and results expire later."""

from __future__ import annotations

import json

from app.state import keys, retention


def test_release_trained(redis_client):
    r = redis_client
    gid = "ret-g0"
    rids = [f"{gid}.0.a", f"{gid}.0.b", f"{gid}.1.c"]  # sibling 0 took two attempts
    for rid in rids:
        r.hset(keys.rollout(rid), "status", "done")
        r.rpush(keys.rollout_calls(rid), "{}")
        r.rpush(keys.group_rollouts(gid), rid)
    r.hset(keys.group(gid), mapping={"task_ids": json.dumps(["t0", "t1"]),
                                     "callback_id": "cb"})
    r.hset(keys.group_results(gid), "0", "{}")
    for task in ("t0", "t1", "cb"):
        r.set(retention.celery_result_key(task), "{}")
    r.set(keys.group_done(gid), "1")
    deleted = retention.release_trained(r, [gid], keep_s=120)
    assert deleted == 2 * len(rids) + 1 + 3
    assert not any(r.exists(keys.rollout(x), keys.rollout_calls(x)) for x in rids)
    assert not r.exists(*(retention.celery_result_key(t) for t in ("t0", "t1", "cb")))
    assert 0 < r.ttl(keys.group(gid)) <= 120 and 0 < r.ttl(keys.group_results(gid)) <= 120
    assert r.ttl(keys.group_done(gid)) == -1  # the exactly-once guard stays

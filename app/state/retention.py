"""Releasing what a trained group no longer needs, so Redis does not grow with what a long run
captured.

A group's captured calls (prompt and response token ids, log-probs: the bulk of a run's
Redis memory, and quadratic in the turns of a multi-turn agent) and its rollout records are
needed until the update that trains the group has stored its result: a redelivered trainer
task returns that stored result, and a restarted trainer restores weights from a checkpoint
and trains only the step it was sent. So they are deleted right after the step's result is
stored, with the Celery results of the group's siblings and chord callback (copies of the
sibling results). The group record and its sibling results (a few KB) expire
``trainer.trained_data_ttl_s`` later: long enough to look at what a step trained, short
enough that a long run keeps about 80 bytes per trained rollout. The exactly-once guards
(``group_done``, ``group_trained``) live ``GUARD_TTL_S`` (a week, as the rollout records
left behind by a crash do): a late duplicate callback or a retried step must still find them,
and a long run must not keep one per group for ever.

Groups that are never trained (dropped, filtered, cancelled) keep their data, record and
results for ``UNTRAINED_TTL_S``, since siblings may still be stopping and a debugging user may
want to look. A result stored later for a group no longer active (a late sibling) gives
results that had no TTL one (``UNTRAINED_TTL_S``; ``GUARD_TTL_S`` for a selected group not yet
trained), so nothing a run leaves lives for ever.
"""

from __future__ import annotations

import json

import redis

from app.state import keys

UNTRAINED_TTL_S = 3600
GUARD_TTL_S = 7 * 24 * 3600


def _rollout_keys(rollout_ids: list[str]) -> list[str]:
    out: list[str] = []
    for rid in rollout_ids:
        out += [keys.rollout(rid), keys.rollout_calls(rid), keys.rollout_turns(rid)]
    return out


def celery_result_key(task_id: str) -> str:
    """The Redis key of a Celery task's result (the Redis result backend's naming)."""
    from celery.backends.base import KeyValueStoreBackend

    return KeyValueStoreBackend.task_keyprefix + task_id


def release_trained(client: redis.Redis, group_ids: list[str], keep_s: float) -> int:
    """Delete what trained groups no longer need, and let the rest expire after ``keep_s``;
    -> keys deleted."""
    pipe = client.pipeline(transaction=False)
    for gid in group_ids:
        pipe.lrange(keys.group_rollouts(gid), 0, -1)
        pipe.hmget(keys.group(gid), "task_ids", "callback_id")
    answers = pipe.execute()
    doomed: list[str] = []
    for i, gid in enumerate(group_ids):
        rids, (task_ids, callback_id) = answers[2 * i], answers[2 * i + 1]
        doomed += _rollout_keys(rids) + [keys.group_rollouts(gid)]
        tasks = json.loads(task_ids or "[]") + ([callback_id] if callback_id else [])
        doomed += [celery_result_key(t) for t in tasks]
    deleted = 0
    for i in range(0, len(doomed), 500):
        deleted += int(client.delete(*doomed[i:i + 500]))
    pipe = client.pipeline(transaction=False)
    for gid in group_ids:
        pipe.expire(keys.group(gid), max(int(keep_s), 1))
        pipe.expire(keys.group_results(gid), max(int(keep_s), 1))
    pipe.execute()
    return deleted


def expire_untrained(client: redis.Redis, group_id: str) -> None:
    """Shorten the life of a dropped, filtered or cancelled group: its captured data, its
    record (which holds the whole sample) and its sibling results."""
    rids = client.lrange(keys.group_rollouts(group_id), 0, -1)
    pipe = client.pipeline(transaction=False)
    for key in _rollout_keys(rids) + [keys.group_rollouts(group_id), keys.group(group_id),
                                      keys.group_results(group_id)]:
        pipe.expire(key, UNTRAINED_TTL_S)
    pipe.execute()

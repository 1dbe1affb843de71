"""Releasing what a trained group no longer needs, so Redis stays flat over a long run.

A group's captured calls (prompt and response token ids, log-probs: the bulk of a run's
Redis memory, and quadratic in the turns of a multi-turn agent) and its rollout records are
needed until the update that trains the group has stored its result: a redelivered trainer
task returns that stored result, and a restarted trainer restores weights from a checkpoint
and trains only the step it was sent. So they are deleted right after the step's result is
stored. The group record and its sibling results (small) stay, for the run's accounting;
so do the Celery results of its siblings until Celery's ``result_expires``.

Groups that are never trained (dropped, cancelled) keep their data for ``UNTRAINED_TTL_S``,
since siblings may still be stopping and a debugging user may want to look.
"""

from __future__ import annotations

import redis

from app.state import keys

UNTRAINED_TTL_S = 3600


def _rollout_keys(rollout_ids: list[str]) -> list[str]:
    out: list[str] = []
    for rid in rollout_ids:
        out += [keys.rollout(rid), keys.rollout_calls(rid)]
    return out


def release_trained(client: redis.Redis, group_ids: list[str]) -> int:
    """Delete the captured calls and rollout records of trained groups; -> keys deleted."""
    pipe = client.pipeline(transaction=False)
    for gid in group_ids:
        pipe.lrange(keys.group_rollouts(gid), 0, -1)
    doomed: list[str] = []
    for gid, rids in zip(group_ids, pipe.execute(), strict=True):
        doomed += _rollout_keys(rids) + [keys.group_rollouts(gid)]
    deleted = 0
    for i in range(0, len(doomed), 500):
        deleted += int(client.delete(*doomed[i:i + 500]))
    return deleted


def expire_untrained(client: redis.Redis, group_id: str) -> None:
    """Shorten the life of a dropped or cancelled group's captured data."""
    rids = client.lrange(keys.group_rollouts(group_id), 0, -1)
    pipe = client.pipeline(transaction=False)
    for key in _rollout_keys(rids) + [keys.group_rollouts(group_id)]:
        pipe.expire(key, UNTRAINED_TTL_S)
    pipe.execute()

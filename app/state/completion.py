"""Group completion: the chord callback's work (run by the groups worker; the driver's
reconcile pass runs it too, for a callback that never ran).

Invariants:
- A group becomes complete (or dropped) exactly once. The ``group_done`` key is taken with
  SET NX before anything else is written, so a callback that runs twice (a redelivered
  message, a retried chord) finds it taken and changes nothing.
- Completion and cancellation (the driver's age cap) exclude each other: the status check,
  the SET NX and the outcome's writes are one Redis script, so a group cancelled at any
  moment before it is never marked complete (it would be trained although its prompt was
  re-queued), and one completed before it is removed from the ready set by the cancel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from app.state import keys, retention
from app.state.records import SUCCESS_REWARD, GroupRecord, SiblingResult
from app.state.runs import MissingState, read_group, run_config

log = logging.getLogger(__name__)


# the completion outcomes no step trains: their data expires (retention.expire_untrained)
UNTRAINED = ("dropped", "filtered")

# The early flag goes only on a record that still exists: a plain HSET on one that expired
# since it was read would bring it back as a one-field hash without a TTL, kept for good.
_FLAG_EARLY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], '1')
return 1
"""


def sibling_results(client: redis.Redis, group_id: str) -> dict[int, SiblingResult]:
    raw = client.hgetall(keys.group_results(group_id))
    return {int(k): SiblingResult.from_json(v) for k, v in raw.items()}


def finish_group(client: redis.Redis, group_id: str) -> str:
    try:
        group = read_group(client, group_id)
    except MissingState:  # a cancelled or dropped group's record expired before this callback
        log.info("group %s: no record left (expired after it was dropped or cancelled); "
                 "nothing to complete", group_id)
        return "gone"
    results = _every_sibling(client, group_id, group)
    if isinstance(results, str):
        return results
    try:
        cfg = run_config(client, group.run_id)
    except MissingState:  # an evaluation run's record outlives its groups' by less
        return _gone(group_id)
    failed = [r for r in results.values() if r.status != "ok"]
    outcome = "dropped" if failed and cfg.controller.on_failure == "requeue" else "complete"
    filtering = cfg.algorithm.filter_groups
    if outcome == "complete" and filtering.enable \
            and equal_rewards(results.values(), filtering.metric):
        outcome = "filtered"
    run = group.run_id
    limit = cfg.data.max_prompt_failures or 0
    answer = client.register_script(_COMPLETE)(
        keys=[keys.group(group_id), keys.group_done(group_id), keys.run_active(run),
              keys.run_ready(run), keys.run_requeue(run), keys.run(run), keys.run_wakeup(run),
              keys.group_results(group_id), keys.run_prompt_failures(run),
              keys.run_quarantined(run)],
        args=[group_id, outcome, str(time.time()), group.seq, group.sample_index,
              limit, (failed[0].error or "") if failed else "", retention.GUARD_TTL_S])
    return _settled(client, group, str(answer), failed, len(results), limit)


def _every_sibling(client: redis.Redis, group_id: str, group: GroupRecord
                   ) -> dict[int, SiblingResult] | str:
    """Every sibling's result, or what the callback answers when some are missing."""
    results = sibling_results(client, group_id)
    if len(results) >= group.n:
        return results
    # Only a chord that fired early could get here (a sibling that ran twice: a worker
    # wrongly presumed dead). Never mark a partial group; flag it so the last sibling to
    # store its result finishes it (flag first, then look again: one of the two sides
    # always sees the other).
    if not client.register_script(_FLAG_EARLY)(
            keys=[keys.group(group_id)], args=[GroupRecord.field("callback_early")]):
        return _gone(group_id)
    results = sibling_results(client, group_id)
    if len(results) < group.n:
        log.warning("group %s: callback saw %d of %d siblings; the last sibling will "
                    "complete it", group_id, len(results), group.n)
        return "incomplete"
    return results


# the completion script's answers for a group that will never be trained
_UNTRAINED_ANSWERS = ("dropped", "dropped_quarantined", "quarantined", "filtered")


def _settled(client: redis.Redis, group: GroupRecord, answer: str,
             failed: list[SiblingResult], siblings: int, limit: int) -> str:
    """What the completion script answered, said in the log; a group that is never trained
    gets its short life. Quarantine is a drop to the caller."""
    group_id = group.group_id
    if answer == "gone":
        return _gone(group_id)
    if answer == "duplicate":
        log.info("group %s: completion already recorded (duplicate callback)", group_id)
        # the first callback may have died before shortening a never-trained group's life
        if client.hget(keys.group(group_id), GroupRecord.field("status")) in UNTRAINED:
            retention.expire_untrained(client, group_id)
        return answer
    if answer not in _UNTRAINED_ANSWERS:
        return answer  # complete, or cancelled meanwhile: left as it was
    retention.expire_untrained(client, group_id)
    if answer == "dropped":
        log.warning("group %s dropped and its prompt re-queued: %d sibling(s) failed (%s)",
                    group_id, len(failed), failed[0].error)
    elif answer == "dropped_quarantined":
        log.warning("group %s dropped: %d sibling(s) failed (%s); its prompt %d is "
                    "quarantined, not re-queued", group_id, len(failed), failed[0].error,
                    group.sample_index)
        answer = "dropped"
    elif answer == "quarantined":
        log.error("prompt %d quarantined: its groups were dropped %d times "
                  "(data.max_prompt_failures); it is not re-queued again. Last group %s, "
                  "%d sibling(s) failed, last error: %s", group.sample_index, limit,
                  group_id, len(failed), failed[0].error)
        answer = "dropped"
    elif answer == "filtered":
        log.info("group %s filtered (algorithm.filter_groups): all %d rewards equal", group_id,
                 siblings)
    return answer


def _gone(group_id: str) -> str:
    # expired (dropped or cancelled long ago), or its run's did, while the callback ran
    log.info("group %s: its records (or its run's) expired while the callback ran; nothing "
             "to complete", group_id)
    return "gone"


def equal_rewards(results: Iterable[SiblingResult], metric: str) -> bool:
    """Whether a complete group's rollouts all scored the same under ``metric`` (its GRPO
    advantages are then all zero). A failed rollout scores 0 (``on_failure: zero_reward``)."""
    def value(r: SiblingResult) -> float:
        reward = float(r.reward) if r.status == "ok" and r.reward is not None else 0.0
        return float(reward >= SUCCESS_REWARD) if metric == "acc" else reward

    return len({value(r) for r in results}) <= 1


# Status check, exactly-once mark and the outcome's writes in one step (see the invariants).
# A dropped group's prompt is re-queued unless its groups have now been dropped ARGV[6]
# times (0: no limit): then it is quarantined with its last error (once: the answer is
# 'quarantined' the first time, 'dropped' after). A record that expired since it was read
# is left gone ('gone'), not brought back without a TTL. A filtered group leaves the active set
# like a dropped one (its slot is free), and its prompt is not re-queued.
# KEYS: group, group_done, run_active, run_ready, run_requeue, run, run_wakeup, group_results,
#       run_prompt_failures, run_quarantined
# ARGV: group id, outcome (complete | dropped | filtered), completed_at, seq, sample index,
#       max prompt failures, the last error, the guard's TTL (s)
_COMPLETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'gone' end
if redis.call('HGET', KEYS[1], 'status') == 'cancelled' then return 'cancelled' end
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[8]) then return 'duplicate' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'completed_at', ARGV[3])
local answer = ARGV[2]
if ARGV[2] == 'complete' then
  redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
else
  if redis.call('ZREM', KEYS[3], ARGV[1]) == 1 then  -- app.state.carry's count
    redis.call('HINCRBY', KEYS[6], 'finished_active', 0 - redis.call('HLEN', KEYS[8]))
  end
  if ARGV[2] == 'filtered' then
    redis.call('HINCRBY', KEYS[6], 'n_filtered', 1)
  else
    redis.call('HINCRBY', KEYS[6], 'n_dropped', 1)
    local failures = redis.call('HINCRBY', KEYS[9], ARGV[5], 1)
    local limit = tonumber(ARGV[6])
    if limit > 0 and failures >= limit then
      if redis.call('HSETNX', KEYS[10], ARGV[5], ARGV[7]) == 1 then
        redis.call('HINCRBY', KEYS[6], 'n_quarantined', 1)
        answer = 'quarantined'
      else
        answer = 'dropped_quarantined'  -- its prompt already was: not re-queued either
      end
    else
      redis.call('RPUSH', KEYS[5], ARGV[5])
      redis.call('HINCRBY', KEYS[6], 'n_requeued', 1)
    end
  end
end
redis.call('RPUSH', KEYS[7], ARGV[1])
return answer
"""

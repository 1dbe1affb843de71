"""What a run carries over, counted exactly and in O(1): the run hash's ``finished_active``
field is the number of sibling results stored for groups that are still active.

Invariant: the count changes only inside the same Redis script (or MULTI) as the change it
depends on, so no interleaving of siblings, callbacks and the driver can make it drift:
- a sibling's first result for an active group adds 1 (``store_sibling_result``);
- a group leaving the active set subtracts its stored results: selected (``n`` each, in the
  selection's MULTI), dropped or filtered (the completion script), cancelled
  (``cancel_group``).
Results stored for a group that is no longer active (a late sibling of a cancelled group, a
sibling that ran twice) are not counted.

Unfinished rollouts carried over = active groups x n - ``finished_active``.
"""

from __future__ import annotations

import redis

from app.state import keys, retention
from app.state.records import RunRecord

FIELD = RunRecord.field("finished_active")

# KEYS: group_results, run_active, run, group   ARGV: sibling index, result JSON, group id,
# untrained TTL, guard TTL   -> 1 a new result, 0 an overwrite (a redelivered sibling). A
# result for a group no longer active, whose results have no TTL, gives them one: the short
# one when the group will never be trained (cancelled, dropped, filtered, or its record
# already expired), else (selected, not yet trained) a week, far past any step.
STORE = """
local new = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('ZSCORE', KEYS[2], ARGV[3]) then
  if new == 1 then redis.call('HINCRBY', KEYS[3], 'finished_active', 1) end
elseif redis.call('TTL', KEYS[1]) == -1 then
  local status = redis.call('HGET', KEYS[4], 'status')
  if status == 'selected' then
    redis.call('EXPIRE', KEYS[1], ARGV[5])
  else
    redis.call('EXPIRE', KEYS[1], ARGV[4])
  end
end
return new
"""

# KEYS: group, run_active, run_ready, run_requeue, run, group_results
# ARGV: group id, sample index   -> 1 cancelled, 0 not active (selected or gone meanwhile)
CANCEL = """
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('RPUSH', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[5], 'n_cancelled', 1)
redis.call('HINCRBY', KEYS[5], 'n_requeued', 1)
-- 0 - x, not -x: Redis refuses the "-0" that -0 would send
redis.call('HINCRBY', KEYS[5], 'finished_active', 0 - redis.call('HLEN', KEYS[6]))
return 1
"""


def store_sibling_result(client: redis.Redis, run_id: str, group_id: str, index: int,
                         result_json: str) -> bool:
    return bool(client.register_script(STORE)(
        keys=[keys.group_results(group_id), keys.run_active(run_id), keys.run(run_id),
              keys.group(group_id)],
        args=[str(index), result_json, group_id, retention.UNTRAINED_TTL_S,
              retention.GUARD_TTL_S]))


def cancel_group(client: redis.Redis, run_id: str, group_id: str, sample_index: int) -> bool:
    return bool(client.register_script(CANCEL)(
        keys=[keys.group(group_id), keys.run_active(run_id), keys.run_ready(run_id),
              keys.run_requeue(run_id), keys.run(run_id), keys.group_results(group_id)],
        args=[group_id, sample_index]))


def carried(client: redis.Redis, run_id: str, n: int) -> tuple[int, int, int]:
    """(unfinished rollouts, finished siblings, rollouts of complete groups) among the
    active groups: what the next step inherits. Read in one MULTI: a group that leaves
    the active set between the reads would count n unfinished rollouts too many."""
    pipe = client.pipeline(transaction=True)
    pipe.zcard(keys.run_active(run_id))
    pipe.zcard(keys.run_ready(run_id))
    pipe.hget(keys.run(run_id), FIELD)
    active, ready, finished = pipe.execute()
    finished = int(finished or 0)
    return int(active) * n - finished, finished, int(ready) * n

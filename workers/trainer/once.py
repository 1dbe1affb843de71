"""A step is trained at most once, and a group in at most one step.

The driver re-sends a step whose trainer went silent, the broker may deliver a task twice,
and a Redis crash may lose the last second of writes; none of them may put a group's
rollouts into the policy twice. Four records keep the rule, each covering what the one
before cannot:

1. **The step's stored result** (``keys.run_step_result``), written when the step is
   recorded. A step that finds it answers with it and trains nothing (:func:`stored_answer`).
2. **This process's memory of the steps it trained** (:func:`remembered`), with the
   generation of the resident trainer that holds each update. A Redis crash can lose the
   stored result while this process's weights already hold the update: the step is
   answered from memory (and its result stored again), not trained again. Once that trainer
   is replaced (reloaded from a checkpoint), its weights no longer hold the update, and the
   step is trained again.
3. **The resident trainer's ``updated_step``** (``resident.Resident``): an update that ran
   here but whose step failed after it (a publish that did not go through) is published
   again, its groups not trained again (:func:`update_already_in_weights`). One such try:
   should the publish fail again, the next attempt reloads the last checkpoint.
4. **Each group's claim** (``keys.group_trained``, kept ``retention.GUARD_TTL_S``): a group
   is claimed by one step; a retry of that step claims it again, another step leaves it out
   (:func:`claim_groups`).

:func:`record` writes (1) and releases what the groups captured, in that order: a re-sent
step that finds the result does not read the captured calls again.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import redis

from app.state import keys, retention
from app.state.runs import run_config
from workers.trainer.weight_sync.base import Metrics

if TYPE_CHECKING:
    from workers.trainer.resident import Resident

log = logging.getLogger(__name__)

# (run id, step) -> (its metrics, the generation of the trainer whose weights hold it); the
# last few steps this process trained
_trained: dict[tuple[str, int], tuple[Metrics, int | None]] = {}
TRAINED_KEPT = 8


def remembered(client: redis.Redis, run_id: str, step: int, generation: int | None
               ) -> Metrics | None:
    """Record (2): the metrics of ``step`` if this process trained it and the trainer that
    holds the update (``generation``) is still the one loaded. A stored result the memory
    answers for is stored again."""
    done, held_by = _trained.get((run_id, step), (None, None))
    if done is None or held_by != generation:
        return None
    if client.set(keys.run_step_result(run_id, step), json.dumps(done), nx=True):
        log.warning("step %s of run %s: its stored result was lost (a Redis crash); "
                    "answered from this worker's memory, not trained again", step, run_id)
    return done


def remember(run_id: str, step: int, metrics: Metrics, generation: int | None) -> None:
    """Record (2) for a step this process trained (``generation`` None: it was answered
    from a stored result, trained elsewhere, and is not remembered)."""
    if generation is None:
        return
    _trained[(run_id, step)] = (metrics, generation)
    while len(_trained) > TRAINED_KEPT:
        del _trained[next(iter(_trained))]


def stored_answer(client: redis.Redis, run_id: str, step: int) -> Metrics | None:
    """Record (1): the stored result of ``step``, if it was recorded. The worker that
    stored it may have died before releasing what the groups captured: released again
    (idempotent: what was released is gone, the rest gets its TTL again)."""
    done = client.get(keys.run_step_result(run_id, step))
    if done is None:
        return None
    log.info("step %d of run %s already trained (redelivery); returning its metrics",
             step, run_id)
    groups = client.lrange(keys.run_step_groups(run_id, step), 0, -1)
    if groups:
        keep_s = run_config(client, run_id).trainer.trained_data_ttl_s
        retention.release_trained(client, groups, keep_s)
    return dict(json.loads(done))


def update_already_in_weights(resident: Resident, step: int) -> bool:
    """Record (3): whether this step's update already ran in this trainer (the step failed
    after it, before it was recorded)."""
    if not (resident.unrecorded and resident.updated_step == step):
        return False
    log.warning("step %d: its update is already in this trainer's weights (the step failed "
                "after it); publishing it again, its groups not trained again", step)
    return True


def publishing_again(resident: Resident) -> None:
    """Record (3) is used up once such an update's publish starts: should it fail again
    (weights the servers cannot load, say), the next attempt reloads the last checkpoint
    instead of trying them for ever. A pause lost before the publish started (the weights
    untouched) leaves the mark, so the step taken up again publishes, not rolls back."""
    resident.updated_step = None


def claim_groups(client: redis.Redis, group_ids: list[str], step: int) -> list[str]:
    """Record (4): the groups ``step`` may train; a group another step claimed is left out."""
    claimed = []
    for gid in group_ids:
        key = keys.group_trained(gid)
        if client.set(key, step, nx=True, ex=retention.GUARD_TTL_S) \
                or client.get(key) == str(step):
            claimed.append(gid)
        else:
            log.error("group %s was already trained at step %s; not training it again",
                      gid, client.get(key))
    return claimed


def record(client: redis.Redis, run_id: str, step: int, group_ids: list[str],
           metrics: Metrics, keep_s: float) -> None:
    """Record (1) for a trained step, then release what its groups captured."""
    client.set(keys.run_step_result(run_id, step), json.dumps(metrics))
    retention.release_trained(client, group_ids, keep_s)

"""Calling the trainer worker, surviving its death.

Trainer tasks are acknowledged on receipt (``acks_late=False`` in ``workers.trainer.tasks``):
the broker never redelivers them on its own, hours later. Instead the driver watches the
task's heartbeat (``keys.trainer_heartbeat``, refreshed by the worker every
``trainer.heartbeat_s / 4``). A heartbeat that was seen and then expired without a result
means the worker died mid-task; the driver sends the task again (up to
``trainer.step_retries`` times) and the restarted worker resumes from the run's last
checkpoint. Liveness, not a clock, decides: ``trainer.step_timeout_s`` bounds only the wait
for some trainer worker to take the task. Trainer tasks are idempotent, so a slow-but-alive
worker finishing the first copy costs only a cached answer to the second.

A task whose every attempt killed its worker (an update too big for memory, which the
kernel's OOM killer ends with SIGKILL) fails with one line naming what ended the worker each
time: the exits the supervisor recorded (``keys.role_exits``) since the task was first sent.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis
from celery.exceptions import TimeoutError as CeleryTimeout

from app.config.schema import Config
from app.driver.metrics import Metrics
from app.state import keys
from app.state.records import RoleExit

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    from app.driver.recovery import OutageWatch

log = logging.getLogger(__name__)


RESULT_GRACE_S = 3.0
# what bounds the memory of an update's micro-batches (docs/gpu.md, "Micro-batch memory")
UPDATE_MEMORY_KNOBS = ("ppo_max_token_len_per_gpu", "micro_batch_memory_gb",
                       "ppo_micro_batch_size_per_gpu")


def glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis key pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class TrainerLost(RuntimeError):
    """The trainer worker died during the task (its heartbeat expired)."""


def update_memory_knobs(cfg: Config) -> str:
    """The settings that bound an update's memory, with their values, for a give-up line."""
    actor = cfg.actor_rollout_ref.actor
    values = {k: getattr(actor, k) for k in UPDATE_MEMORY_KNOBS}
    named = [f"actor_rollout_ref.actor.{k} ({'null' if v is None else v})"
             for k, v in values.items()]
    return (f"an update's memory is bounded by {', '.join(named[:-1])} and {named[-1]}: "
            'see docs/gpu.md, "Micro-batch memory"')


def trainer_exits(client: redis.Redis, since: str) -> list[RoleExit]:
    """The trainer's exits recorded since the stream id ``since``, oldest first; one whose
    record was written twice (a lost reply) once."""
    found = [RoleExit.from_hash(fields)
             for _, fields in client.xrange(keys.role_exits(), min=since)]
    return list({(e.host, e.pid, e.at): e for e in found if e.role == "trainer"}.values())


def _exits_said(exits: list[RoleExit]) -> str:
    if not exits:
        return ("no exit of the trainer worker was recorded, only its heartbeat expired (the "
                "exits of a worker started by `carryover up` or `carryover demo` are; not "
                "those of one started outside that supervisor: by hand, by `make up`/`honcho "
                "start`, or by Kubernetes): see its log, and `dmesg` for an OOM kill")
    if len(exits) == 1:
        return f"1 exit recorded: {exits[0].describe()}"
    causes = ", ".join(f"{cause} x{n}" if n > 1 else cause
                       for cause, n in Counter(e.cause for e in exits).items())
    return f"{len(exits)} exits recorded ({causes}), the last: {exits[-1].describe()}"


def _redis_now(client: redis.Redis) -> str:
    """Redis's clock as a stream id: the exits recorded from now on are at or after it."""
    seconds, micros = client.time()
    return f"{int(seconds) * 1000 + int(micros) // 1000}-0"


class TrainerTimeout(RuntimeError):
    pass


class RedisOutageEnded(RuntimeError):
    """Redis was unreachable while the task ran and is back: the task message (and what the
    driver wrote just before it) may be among the writes a crash lost."""


def _await(client: redis.Redis, result: AsyncResult, heartbeat_key: str, timeout_s: float,
           poll_s: float, outage: OutageWatch | None = None,
           each_poll: Callable[[], object] | None = None,
           run_heartbeats: str | None = None) -> Metrics:
    """``run_heartbeats``: a key pattern of every trainer task of the run; while one of them
    beats, a task not yet taken waits behind it (the worker runs one task at a time: a
    resumed driver's ``init_run`` behind the step a dead driver sent) instead of timing
    out."""
    start = time.monotonic()
    seen = False
    waited_behind = False
    while True:
        try:
            return result.get(timeout=poll_s, propagate=True, disable_sync_subtasks=False)
        except CeleryTimeout:
            pass
        if outage is not None and outage.pending():
            raise RedisOutageEnded("Redis was unreachable while the task ran")
        if each_poll is not None:
            each_poll()
        alive = bool(client.exists(heartbeat_key))
        if alive:
            seen = True
        elif seen and not result.ready():
            # the worker ends its heartbeat just before Celery stores the task's result: a
            # moment's grace before calling it dead
            try:
                return result.get(timeout=RESULT_GRACE_S, propagate=True,
                                  disable_sync_subtasks=False)
            except CeleryTimeout:
                raise TrainerLost(f"the trainer worker's heartbeat ({heartbeat_key}) "
                                  "expired without a result") from None
        # Only a task nobody took times out: a trainer that heartbeats is alive, however
        # long its update takes (a 7B update plus its weight load can take many minutes).
        if not seen and time.monotonic() - start > timeout_s and run_heartbeats:
            busy = [k for k in client.scan_iter(match=run_heartbeats, count=1000)
                    if k != heartbeat_key]
            if busy:
                if not waited_behind:
                    log.warning("the trainer worker is still busy with %s of this run (sent "
                                "before this driver started); waiting for it", busy[0])
                    waited_behind = True
                start = time.monotonic()
        if not seen and time.monotonic() - start > timeout_s:
            raise TrainerTimeout(
                f"no trainer worker took the task within {timeout_s:.0f} s "
                "(trainer.step_timeout_s): is one running on queue 'trainer'?")


def _stop_waiting(app: Celery, result: AsyncResult) -> None:
    """Unsubscribe from a result no longer waited for (answered, or given up for a copy
    sent again), now: Celery otherwise does it when the object is collected, maybe after
    Redis went away, and then waits out the reconnect budget in a finalizer."""
    try:
        app.backend.remove_pending_result(result)
    except Exception as exc:  # noqa: BLE001 - Redis gone: nothing left to unsubscribe from
        log.debug("could not unsubscribe from %s: %s", result.id, exc)


def call_trainer(client: redis.Redis, cfg: Config, task: str, run_id: str, label: str,
                 args: Sequence[str | int], poll_s: float = 0.5,
                 while_running: Callable[[], object] | None = None,
                 outage: OutageWatch | None = None,
                 after_outage: Callable[[], object] | None = None,
                 if_lost: str = "") -> Metrics:
    """Run trainer task ``task`` and return its result, re-sending it when the worker dies.

    ``while_running`` is called right after the first send and then at every poll: work the
    driver does while the trainer does its own (refilling slots that groups free meanwhile).
    When a Redis outage that ``outage`` hears of ends while the task runs, ``after_outage``
    is called (the driver redoes its own lost writes) and the task is sent again, not
    counted as an attempt: a crash may have lost its message, and a copy that ran already
    answers from its stored result. ``if_lost`` ends the message of the ``TrainerLost``
    raised when every attempt killed the worker (the settings that would spare it)."""
    from app.celery_app import celery_app

    retries = int(cfg.trainer.step_retries)
    key = keys.trainer_heartbeat(run_id, label)
    since = _redis_now(client)  # the worker's exits from here on are this task's
    attempt = 0
    first = True
    while True:
        result = celery_app.send_task(task, args=args)
        try:
            if while_running is not None and first:
                while_running()
            first = False
            return _await(client, result, key, float(cfg.trainer.step_timeout_s), poll_s,
                          outage, while_running,
                          keys.trainer_heartbeat(glob_escape(run_id), "*"))
        except RedisOutageEnded:
            if after_outage is not None:
                after_outage()
            elif outage is not None:
                outage.take()
            log.warning("Redis was unreachable during %s %s: sending it again (a copy that "
                        "already ran answers from its stored result)", task, label)
            continue
        except TrainerLost as exc:
            if attempt == retries:
                said = _exits_said(trainer_exits(client, since))
                raise TrainerLost(f"the trainer worker died in each of {retries + 1} attempts "
                                  f"(trainer.step_retries {retries}); {said}"
                                  + (f"; {if_lost}" if if_lost else "")) from None
            log.warning("%s (%s %s): sending it again (attempt %d of %d)", exc, task, label,
                        attempt + 2, retries + 1)
            attempt += 1
        finally:
            _stop_waiting(celery_app, result)

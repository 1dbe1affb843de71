"""One sibling of a prompt group: run the agent (with retries) and record the result.

Invariants:
- Every attempt gets a fresh rollout id and token, so calls from an abandoned or
  redelivered attempt can never mix into the attempt that is trained.
- The result is stored with HSET on the sibling's own field: a redelivered task either
  finds the finished result and returns it, or runs again and overwrites its own field.
- Nothing raises out of :func:`run_sibling`: a chord whose sibling raised would never call
  its callback, so failures are results.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import secrets
import time
from typing import Any

import redis

from app.state import cached_reads, carry, keys
from app.state.records import RolloutRecord, RunRecord, SiblingResult
from app.state.runs import MissingState, read_group, run_config
from workers.rollout.controller import (
    AgentError,
    LLMEndpoint,
    PauseAwareClock,
    make_controller,
)
from workers.rollout.reaper import WORKER_ID

log = logging.getLogger(__name__)

ROLLOUT_TTL_S = 7 * 24 * 3600


def _start_attempt(client: redis.Redis, run_id: str, group_id: str, index: int, attempt: int,
                   temperature: float | None = None) -> tuple[str, str]:
    rollout_id = f"{group_id}.{index}.{secrets.token_hex(4)}"
    token = secrets.token_urlsafe(24)
    rec = RolloutRecord(rollout_id=rollout_id, run_id=run_id, group_id=group_id, index=index,
                        attempt=attempt, token_sha256=hashlib.sha256(token.encode()).hexdigest(),
                        created_at=time.time(), temperature=temperature, worker=WORKER_ID)
    pipe = client.pipeline()
    pipe.hset(keys.rollout(rollout_id), mapping=rec.to_hash())
    pipe.expire(keys.rollout(rollout_id), ROLLOUT_TTL_S)
    pipe.rpush(keys.group_rollouts(group_id), rollout_id)  # so all of it can be released
    pipe.expire(keys.group_rollouts(group_id), ROLLOUT_TTL_S)
    pipe.execute()
    return rollout_id, token


# KEYS: rollout, rollout_calls   ARGV: status, ttl   -> 1 closed, 0 not running (closed
# already, or its record released after training or expired: nothing is recreated). The calls
# get a TTL only when they have none: a cancelled group's shorter one (retention) stays.
_CLOSE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
if redis.call('TTL', KEYS[2]) == -1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return 1
"""


def _close_attempt(client: redis.Redis, rollout_id: str, status: str) -> bool:
    """Close a running rollout; the gateway then refuses its further calls and reward (409)."""
    return bool(client.register_script(_CLOSE)(
        keys=[keys.rollout(rollout_id), keys.rollout_calls(rollout_id)],
        args=[status, ROLLOUT_TTL_S]))


LOST = "lost"  # a rollout's status: a later delivery found its worker dead while it ran


def _sibling_rollouts(client: redis.Redis, group_id: str, index: int) -> list[str]:
    """Every attempt's rollout id of sibling ``index``, from any delivery of its task."""
    prefix = f"{group_id}.{index}."
    return [rid for rid in client.lrange(keys.group_rollouts(group_id), 0, -1)
            if rid.startswith(prefix)]


def _close_earlier_attempts(client: redis.Redis, group_id: str, index: int,
                            keep: str | None) -> list[str]:
    """Close this sibling's rollouts left running by an earlier delivery of its task whose
    worker died (its alive key is gone): a process agent may outlive it on its host, and its
    next model call or reward must be refused, not captured beside the attempt that replaces
    it. An attempt of a live worker (a task delivered twice) is left alone. -> closed ids."""
    earlier = [rid for rid in _sibling_rollouts(client, group_id, index) if rid != keep]
    owners = [client.hget(keys.rollout(rid), RolloutRecord.field("worker")) for rid in earlier]
    # closed as lost: what _lost_attempts counts (not an attempt that ended on its own)
    closed = [rid for rid, owner in zip(earlier, owners, strict=True)
              if not (owner and client.exists(keys.worker_alive(owner)))
              and _close_attempt(client, rid, LOST)]
    if closed:
        log.warning("sibling %s/%d: closed %d rollout(s) a dead worker left running; "
                    "their agents' further calls are refused", group_id, index, len(closed))
    return closed


def _lost_attempts(client: redis.Redis, group_id: str, index: int) -> int:
    """How many of this sibling's attempts a delivery of its task found still running with
    their worker gone (closed ``LOST`` by :func:`_close_earlier_attempts`). A worker's death
    is not the agent's failure and costs it no attempt, but an agent that kills its worker
    (a crash in native code, memory) would be redelivered for ever, never failing, and
    never counted against its prompt (``data.max_prompt_failures``): ``max_lost_attempts``
    bounds it."""
    return sum(client.hget(keys.rollout(rid), RolloutRecord.field("status")) == LOST
               for rid in _sibling_rollouts(client, group_id, index))


CLOSED_ELSEWHERE = "closed by a later delivery of its task"


def _closed_elsewhere(client: redis.Redis, group_id: str, index: int, rollout_id: str,
                      attempt: int) -> SiblingResult:
    """An attempt whose rollout a later delivery of this task closed (this worker was taken
    for dead): its agent met refused calls, so its reward does not describe its calls, and
    it is not tried again. The later delivery's result stands: this one is a failure that
    is not stored (stored, it could complete the group before that delivery's result, and
    drop it or train the cut-off calls), and the delivery that runs on stores its own."""
    log.warning("rollout %s was closed by a later delivery of its task (this worker was taken "
                "for dead); that delivery's result stands", rollout_id)
    return existing_result(client, group_id, index) or SiblingResult(
        index=index, rollout_id=rollout_id, status="failed", reward=None, attempts=attempt,
        seconds=0.0, error=CLOSED_ELSEWHERE)


def _posted(client: redis.Redis, rollout_id: str) -> float | None:
    raw = client.hget(keys.rollout(rollout_id), RolloutRecord.field("reward"))
    return json.loads(raw) if raw is not None else None


def _overflowed(client: redis.Redis, rollout_id: str) -> bool:
    """Whether the gateway refused one of the rollout's calls for the context length."""
    raw = client.hget(keys.rollout(rollout_id), RolloutRecord.field("context_overflow"))
    return int(raw or 0) > 0


def existing_result(client: redis.Redis, group_id: str, index: int) -> SiblingResult | None:
    raw = client.hget(keys.group_results(group_id), str(index))
    return SiblingResult.from_json(raw) if raw else None


def group_status(client: redis.Redis, group_id: str, max_age_s: float = 0.5) -> str | None:
    """A group's status, read at most every ``max_age_s`` per worker process: its ``n``
    siblings' agents all ask on every tick."""
    return cached_reads.read_cached(keys.group(group_id), max_age_s,
                                    lambda: client.hget(keys.group(group_id), "status"))


def run_sibling(client: redis.Redis, group_id: str, index: int) -> SiblingResult:
    done = existing_result(client, group_id, index)
    if done is not None:
        log.info("sibling %s/%d already finished (redelivery); returning its result",
                 group_id, index)
        return done
    try:
        result = _run(client, group_id, index)
    except MissingState as exc:
        # its group's or its run's record is gone: a message redelivered after the group was
        # cancelled or dropped and its records expired. Nothing to run, and nothing to
        # store: a result stored now would only wait for its own TTL.
        log.info("sibling %s/%d: nothing to run, its group's or its run's records are "
                 "gone (%s)", group_id, index, exc)
        return SiblingResult(index=index, rollout_id="", status="failed", reward=None,
                             attempts=0, seconds=0.0, error=f"records expired: {exc}")
    except Exception as exc:  # noqa: BLE001 - a broken sibling is a failed result
        log.exception("sibling %s/%d crashed outside the agent", group_id, index)
        result = SiblingResult(index=index, rollout_id="", status="failed", reward=None,
                               attempts=0, seconds=0.0, error=f"{exc.__class__.__name__}: {exc}")
    if result.error == CLOSED_ELSEWHERE:
        return result  # the later delivery stores the sibling's result
    result.finished_at = time.time()
    store_result(client, group_id, result)
    return result


def store_result(client: redis.Redis, group_id: str, result: SiblingResult) -> None:
    """Store a sibling's result; if the chord callback already fired without it (a sibling
    that ran twice), this last sibling completes the group (store first, then look: see
    ``completion.finish_group``)."""
    run_id = client.hget(keys.group(group_id), "run_id") or ""
    carry.store_sibling_result(client, run_id, group_id, result.index, result.to_json())
    if client.hget(keys.group(group_id), "callback_early") == "1":
        from app.state.completion import finish_group

        log.info("group %s: the chord callback fired early; sibling %d completes the group",
                 group_id, result.index)
        finish_group(client, group_id)


def _run(client: redis.Redis, group_id: str, index: int) -> SiblingResult:
    sibling = _Sibling(client, group_id, index)
    refused = sibling.take_up_earlier()
    if refused is not None:
        return refused
    for attempt in range(1, sibling.ctl.max_attempts + 1):
        result = sibling.attempt(attempt)
        if result is not None:
            return result
    return SiblingResult(index=index, rollout_id=sibling.rollout_id, status="failed",
                         reward=None, attempts=sibling.ctl.max_attempts,
                         seconds=sibling.clock.active, paused_seconds=sibling.clock.paused,
                         error=sibling.error)


class _Sibling:
    """One sibling's attempts: the run's settings, its controller, the pause-aware clock,
    and the agent of an earlier delivery it took up."""

    def __init__(self, client: redis.Redis, group_id: str, index: int) -> None:
        self.client, self.group_id, self.index = client, group_id, index
        self.group = read_group(client, group_id)
        cfg = run_config(client, self.group.run_id)
        self.ctl = cfg.controller
        self.model = cfg.inference.served_model_name
        self.gateway = cfg.gateway.url.rstrip("/")
        # an evaluation's rollouts are sampled at its own temperature (never trained)
        raw = client.hget(keys.run(self.group.run_id), RunRecord.field("temperature"))
        self.temperature = json.loads(raw) if raw else None
        # plain values: a nested setting goes to a process or Kubernetes agent as JSON, and
        # a python agent gets its own copy (the run's config is shared by the worker's
        # threads)
        settings: dict[str, Any] = cfg.select("agent")
        self.controller = make_controller(
            self.ctl.backend, self.ctl.agent, settings, kcfg=self.ctl.kubernetes,
            client=client, gateway_url=self.gateway, run_id=self.group.run_id,
            group_id=group_id, index=index)
        # the pause flag read at most every 0.5 s per worker process: a worker runs hundreds
        # of agents, and each one's clock asks every tick
        self.clock = PauseAwareClock(lambda: cached_reads.gateway_paused(client, 0.5))
        self.adopted: str | None = None
        self.rollout_id = ""
        self.error = ""

    def cancelled(self) -> bool:
        return group_status(self.client, self.group_id) == "cancelled"

    def take_up_earlier(self) -> SiblingResult | None:
        """An agent still running from an earlier delivery of this task is watched, not
        restarted; the other earlier attempts are closed. A sibling whose attempts died with
        their workers too often fails here (its agent may crash the worker)."""
        client, group_id, index = self.client, self.group_id, self.index
        try:
            self.adopted = self.controller.adopt()
        except AgentError as exc:
            log.warning("sibling %s/%d: cannot look for a running agent to adopt: %s",
                        group_id, index, exc)
        for rid in _close_earlier_attempts(client, group_id, index, keep=self.adopted):
            self.controller.stop(rid)  # a Job that adopt() could not find, or would not take
        lost = _lost_attempts(client, group_id, index)
        # (an agent taken up runs outside the worker: it is not what kills workers)
        if self.adopted or lost < self.ctl.max_lost_attempts:
            return None
        log.error("sibling %s/%d: %d of its attempts ran on workers that died (does its agent "
                  "crash the worker?); it fails (controller.max_lost_attempts)", group_id,
                  index, lost)
        return SiblingResult(index=index, rollout_id="", status="failed", reward=None,
                             attempts=lost, seconds=0.0,
                             error=f"{lost} of its attempts ran on workers that died")

    def attempt(self, attempt: int) -> SiblingResult | None:
        """One attempt: its result, or None when it failed and the next one runs."""
        client = self.client
        if self.cancelled():
            if self.adopted:  # the earlier delivery's agent is stopped, not left to its deadline
                self.controller.stop(self.adopted)
                _close_attempt(client, self.adopted, "cancelled")
            return SiblingResult(index=self.index, rollout_id=self.rollout_id, status="failed",
                                 reward=None, attempts=attempt - 1, seconds=0.0,
                                 error="group cancelled")
        if self.adopted:
            rollout_id, token = self.adopted, ""  # the running agent already holds its token
            log.info("sibling %s/%d: adopting the running agent of rollout %s", self.group_id,
                     self.index, rollout_id)
        else:
            rollout_id, token = _start_attempt(client, self.group.run_id, self.group_id,
                                               self.index, attempt, self.temperature)
        self.rollout_id = rollout_id
        llm = LLMEndpoint(base_url=f"{self.gateway}/rollout/{rollout_id}/v1", api_key=token,
                          model=self.model, rollout_id=rollout_id,
                          max_wait_s=self.ctl.retry_max_wait_s)
        self.clock = PauseAwareClock(self.clock.is_paused)
        started = time.monotonic()
        try:
            # each attempt gets the sample as stored: a failed attempt's agent may have
            # changed it (appended its turns), and an abandoned one may still be changing it
            reward = self.controller.run(
                copy.deepcopy(self.group.sample), llm, self.ctl.rollout_timeout_s, self.clock,
                self.cancelled, posted_reward=lambda: _posted(client, rollout_id),
                adopted=bool(self.adopted))
        except Exception as raised:  # noqa: BLE001 - every failure is the attempt's
            return self._failed(attempt, rollout_id, raised, started)
        if not _close_attempt(client, rollout_id, "finished"):
            return _closed_elsewhere(client, self.group_id, self.index, rollout_id, attempt)
        return SiblingResult(index=self.index, rollout_id=rollout_id, status="ok",
                             reward=reward, attempts=attempt,
                             seconds=time.monotonic() - started,
                             paused_seconds=self.clock.paused)

    def _failed(self, attempt: int, rollout_id: str, raised: Exception, started: float
                ) -> SiblingResult | None:
        """An attempt that raised: the sibling's result (cancelled, ended at a context
        overflow, closed by a later delivery), or None to try again."""
        client = self.client
        exc = raised if isinstance(raised, AgentError) else AgentError(
            f"controller raised {raised.__class__.__name__}: {raised}")
        if not isinstance(raised, AgentError):
            log.exception("rollout %s: the controller itself failed", rollout_id)
        self.adopted = None
        if self.cancelled():
            _close_attempt(client, rollout_id, "cancelled")
            return SiblingResult(index=self.index, rollout_id=rollout_id, status="failed",
                                 reward=None, attempts=attempt,
                                 seconds=time.monotonic() - started,
                                 paused_seconds=self.clock.paused, error="group cancelled")
        if self.ctl.on_context_overflow == "end" and _overflowed(client, rollout_id):
            # the conversation outgrew the model: the rollout ends here, its calls so far are
            # trained, with the reward the agent posted or controller.overflow_reward
            if not _close_attempt(client, rollout_id, "finished"):
                return _closed_elsewhere(client, self.group_id, self.index, rollout_id,
                                         attempt)
            posted = _posted(client, rollout_id)
            reward = posted if posted is not None else self.ctl.overflow_reward
            log.info("rollout %s ended at its context overflow (%s); reward %s", rollout_id,
                     exc, reward)
            return SiblingResult(index=self.index, rollout_id=rollout_id, status="ok",
                                 reward=reward, attempts=attempt,
                                 seconds=time.monotonic() - started,
                                 paused_seconds=self.clock.paused)
        if not _close_attempt(client, rollout_id, "failed"):
            # refused because a later delivery closed it: that delivery runs the sibling
            return _closed_elsewhere(client, self.group_id, self.index, rollout_id, attempt)
        self.error = str(exc)
        log.warning("rollout %s attempt %d/%d failed: %s%s", rollout_id, attempt,
                    self.ctl.max_attempts, exc,
                    f"\n--- agent stderr (tail) ---\n{exc.stderr_tail}" if exc.stderr_tail
                    else "")
        return None

"""One sibling's attempts against real Redis (``workers.rollout.episode.run_sibling``, as the
rollout task calls it): what a redelivered task does with the attempts its dead worker left
open, how a controller's own crash is retried, and what a cancelled group leaves behind."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from typing import Any

import pytest

from app.config import load_config
from app.state import carry, keys, retention
from app.state.records import GroupRecord, RunRecord
from workers.rollout import episode
from workers.rollout.episode import _close_attempt, _start_attempt, run_sibling

RUN = "attempts-run"


@pytest.fixture
def group() -> str:
    """A group id of this test's own: a group's status is cached per process for 0.5 s."""
    return f"{RUN}-g{uuid.uuid4().hex[:8]}"


def make_group(client, group: str, *overrides: str) -> Any:
    cfg = load_config(None, ["controller.backend=process", "controller.max_attempts=2",
                             *overrides])
    client.hset(keys.run(RUN), mapping=RunRecord(
        run_id=RUN, config=cfg.to_dict()).to_hash())
    client.hset(keys.group(group), mapping=GroupRecord(
        group_id=group, run_id=RUN, sample_index=0, sample={"text": "abc"}, n=1).to_hash())
    client.zadd(keys.run_active(RUN), {group: 0})
    return cfg


def status(client, rollout_id: str) -> str | None:
    return client.hget(keys.rollout(rollout_id), "status")


def test_a_redelivered_sibling_closes_the_attempt_its_dead_worker_left_running(redis_client,
                                                                             group):
    make_group(redis_client, group, "controller.agent=echo 0.5")
    # the first delivery's attempt, whose worker died with its agent still running
    orphan, _ = _start_attempt(redis_client, RUN, group, 0, 1)
    other, _ = _start_attempt(redis_client, RUN, group, 1, 1)  # a sibling's: not touched
    result = run_sibling(redis_client, group, 0)
    assert result.status == "ok" and result.reward == 0.5 and result.rollout_id != orphan
    # the gateway refuses the orphan's further calls and reward (it serves running ones only)
    assert status(redis_client, orphan) == "lost"
    assert status(redis_client, other) == "running"
    assert status(redis_client, result.rollout_id) == "finished"


def test_the_attempt_of_a_live_worker_is_left_alone(redis_client, group):
    """A task delivered twice while its first worker lives (taken for dead through a long
    Redis outage): the first attempt keeps running; the two results stand side by side."""
    make_group(redis_client, group, "controller.agent=echo 0.5")
    first, _ = _start_attempt(redis_client, RUN, group, 0, 1)
    owner = redis_client.hget(keys.rollout(first), "worker")
    assert owner
    redis_client.set(keys.worker_alive(owner), "1", px=60_000)
    try:
        assert run_sibling(redis_client, group, 0).status == "ok"
    finally:
        redis_client.delete(keys.worker_alive(owner))
    assert status(redis_client, first) == "running"


def test_a_sibling_whose_attempts_keep_dying_with_their_workers_fails(redis_client, group,
                                                                      tmp_path):
    """An agent that kills its worker (a crash in native code) is redelivered, each time
    with all its attempts (a worker's death is not the agent's failure), until its attempts
    lost with their workers reach controller.max_lost_attempts: then it fails (stored, so
    the group ends and its prompt counts a failure) instead of running for ever."""
    ran = tmp_path / "ran"
    agent = f"controller.agent=touch {ran}; echo 0.5"
    make_group(redis_client, group, agent, "controller.max_attempts=1",
               "controller.max_lost_attempts=2")
    _start_attempt(redis_client, RUN, group, 0, 1)  # its worker died (no alive key)
    result = run_sibling(redis_client, group, 0)  # its one attempt is still its own
    assert result.status == "ok" and result.attempts == 1 and ran.exists()
    ran.unlink()
    again = f"{group}x"
    make_group(redis_client, again, agent, "controller.max_attempts=1",
               "controller.max_lost_attempts=2")
    # an attempt that ended on its own before its worker died is not one lost with it
    ended, _ = _start_attempt(redis_client, RUN, again, 0, 1)
    assert _close_attempt(redis_client, ended, "failed")
    _start_attempt(redis_client, RUN, again, 0, 1)  # found running, its worker gone
    assert run_sibling(redis_client, again, 0).status == "ok" and ran.exists()
    ran.unlink()
    again = f"{group}y"
    make_group(redis_client, again, agent, "controller.max_attempts=1",
               "controller.max_lost_attempts=2")
    for _ in range(2):  # two deliveries' attempts, both found running, their workers gone
        _start_attempt(redis_client, RUN, again, 0, 1)
    result = run_sibling(redis_client, again, 0)
    assert result.status == "failed" and "workers that died" in result.error
    assert not ran.exists()  # not run a third time
    assert episode.existing_result(redis_client, again, 0) is not None  # the group can end


class _Broken:
    """A controller that fails outside the agent (an OSError starting it, a Redis blip)."""

    def adopt(self):
        return None

    def run(self, *args, **kwargs):
        raise OSError("[Errno 7] Argument list too long")


def test_a_controller_crash_fails_the_attempt_and_is_retried(redis_client, group,
                                                             monkeypatch):
    make_group(redis_client, group)
    monkeypatch.setattr(episode, "make_controller", lambda *a, **k: _Broken())
    result = run_sibling(redis_client, group, 0)
    assert result.status == "failed" and result.attempts == 2
    assert "OSError" in result.error and "Argument list too long" in result.error
    rollouts = redis_client.lrange(keys.group_rollouts(group), 0, -1)
    assert len(rollouts) == 2
    assert [status(redis_client, r) for r in rollouts] == ["failed", "failed"]


def test_a_cancelled_group_keeps_its_short_retention(redis_client, group):
    make_group(redis_client, group, "controller.agent=sleep 30",
               "controller.rollout_timeout_s=60")
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=run_sibling(redis_client, group, 0)),
                         daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not redis_client.llen(keys.group_rollouts(group)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (rid,) = redis_client.lrange(keys.group_rollouts(group), 0, -1)
    redis_client.rpush(keys.rollout_calls(rid), "{}")  # a call the gateway captured
    # what the driver does to a group past its age cap
    assert carry.cancel_group(redis_client, RUN, group, 0)
    retention.expire_untrained(redis_client, group)
    t.join(20)
    assert not t.is_alive()
    result = box["r"]
    assert result.status == "failed" and result.error == "group cancelled"
    assert status(redis_client, rid) == "cancelled"
    # nothing of a group that is never trained stays longer: calls, record (the whole
    # sample), sibling results (written after the cancel, by this sibling)
    for key in (keys.rollout_calls(rid), keys.group(group), keys.group_results(group)):
        assert 0 < redis_client.ttl(key) <= retention.UNTRAINED_TTL_S, key


def test_a_late_result_for_a_group_whose_data_expired_does_not_stay_for_ever(redis_client,
                                                                             group):
    """A sibling stores its result after its cancelled group's record and results expired:
    the results it makes anew expire too, and the chord callback finds nothing to do."""
    from app.state.completion import finish_group
    from app.state.records import SiblingResult
    from workers.rollout.episode import store_result

    store_result(redis_client, group, SiblingResult(0, "r", "failed", None, 1, 0.1))
    assert 0 < redis_client.ttl(keys.group_results(group)) <= retention.UNTRAINED_TTL_S
    assert finish_group(redis_client, group) == "gone"


@pytest.mark.parametrize("gone", ["released", "closed"])
def test_closing_an_attempt_that_is_no_longer_running_changes_nothing(redis_client, group,
                                                                     gone):
    rid, _ = _start_attempt(redis_client, RUN, group, 0, 1)
    if gone == "released":  # its group was trained and its records deleted
        retention.release_trained(redis_client, [group], keep_s=60)
        assert not _close_attempt(redis_client, rid, "failed")
        assert not redis_client.exists(keys.rollout(rid))  # not recreated without a TTL
    else:
        assert _close_attempt(redis_client, rid, "finished")
        assert not _close_attempt(redis_client, rid, "failed")
        assert status(redis_client, rid) == "finished"


def test_a_call_recorded_after_a_cancel_keeps_the_short_retention(redis_client, group):
    """A call still in flight when its group is cancelled is recorded after the retention
    shortened the rollout's data: its continuity turn must not live a week."""
    from app.state.pause import Admission

    admission = Admission(redis_client)
    rid, token = _start_attempt(redis_client, RUN, group, 0, 1)
    assert admission.record_and_release(admission.admit(rid)[1], ["{}"], turn=("d1", "t1"))
    lease = admission.admit(rid)[1]
    retention.expire_untrained(redis_client, group)
    assert admission.record_and_release(lease, ["{}"], turn=("d2", "t2"))
    for key in (keys.rollout_turns(rid), keys.rollout_calls(rid)):
        assert 0 < redis_client.ttl(key) <= retention.UNTRAINED_TTL_S, key


def test_a_sibling_redelivered_after_its_group_expired_runs_nothing_quietly(redis_client,
                                                                           group, caplog):
    """A sibling message redelivered after its cancelled group's record expired (a worker
    lost for over an hour): nothing to run, nothing stored, and no crash in the log."""
    result = run_sibling(redis_client, group, 0)
    assert result.status == "failed" and "expired" in (result.error or "")
    assert not redis_client.exists(keys.group_results(group))
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_nested_agent_settings_reach_a_process_agent_as_json(redis_client, group):
    """A nested setting (a list, a mapping) is sent as JSON like any other: each attempt
    failed on it ("controller raised TypeError"), so every group was dropped."""
    cmd = ("python3 -c \"import json, os; s = json.loads(os.environ['CARRYOVER_AGENT_SETTINGS']); "
           "print(len(s['tools']) + s['limits']['turns'])\"")
    make_group(redis_client, group, f"controller.agent={cmd}", "agent.tools=[add, mul]",
               "agent.limits={turns: 3}")
    result = run_sibling(redis_client, group, 0)
    assert result.status == "ok" and result.reward == 5.0, result.error


class _Appends:
    """A python agent as written: it appends its turn to the sample's messages, then fails
    once; the retried attempt must start from the stored sample."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def adopt(self):
        return None

    def run(self, sample, llm, *args, **kwargs):
        self.seen.append(len(sample["messages"]))
        sample["messages"].append({"role": "assistant", "content": "half a turn"})
        if len(self.seen) == 1:
            raise RuntimeError("a tool failed")
        return 1.0


def test_a_retried_attempt_starts_from_the_stored_sample(redis_client, group, monkeypatch):
    make_group(redis_client, group)
    redis_client.hset(keys.group(group), mapping=GroupRecord(
        group_id=group, run_id=RUN, sample_index=0, n=1,
        sample={"messages": [{"role": "user", "content": "hi"}]}).to_hash())
    agent = _Appends()
    monkeypatch.setattr(episode, "make_controller", lambda *a, **k: agent)
    result = run_sibling(redis_client, group, 0)
    assert result.status == "ok" and result.attempts == 2
    assert agent.seen == [1, 1]  # the second attempt did not see the first one's turn


class _ClosedMeanwhile:
    """A worker taken for dead: while its agent runs, a later delivery of the task closes its
    rollout (and may have stored its own result); the agent then ends as if all went well."""

    def __init__(self, client, stored=None, fails: bool = False) -> None:
        self.client, self.stored, self.fails = client, stored, fails

    def adopt(self):
        return None

    def run(self, sample, llm, *args, **kwargs):
        assert _close_attempt(self.client, llm.rollout_id, "failed")
        if self.stored is not None:
            carry.store_sibling_result(self.client, RUN, self.stored[0], 0, self.stored[1])
        if self.fails:  # an agent that exits non-zero on its refused calls
            raise episode.AgentError("agent exited with 1: 409 rollout_closed")
        return 1.0  # the fallback reward of an agent whose calls were refused


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "fails"])
@pytest.mark.parametrize("later_result", [False, True], ids=["pending", "stored"])
def test_an_attempt_closed_by_a_later_delivery_does_not_stand_as_ok(redis_client, group,
                                                                     monkeypatch, later_result,
                                                                     fails):
    """Neither retried (a second agent beside the later delivery's) nor stored (it could
    complete the group with a failure before the later delivery's result)."""
    from app.state.records import SiblingResult

    make_group(redis_client, group)
    later = SiblingResult(0, f"{group}.0.later", "ok", 0.25, 1, 1.0)
    monkeypatch.setattr(episode, "make_controller", lambda *a, **k: _ClosedMeanwhile(
        redis_client, (group, later.to_json()) if later_result else None, fails))
    result = run_sibling(redis_client, group, 0)
    assert len(redis_client.lrange(keys.group_rollouts(group), 0, -1)) == 1  # one attempt
    stored = episode.existing_result(redis_client, group, 0)
    if later_result:  # the later delivery's result stands, not overwritten
        assert (result.rollout_id, result.reward) == (later.rollout_id, 0.25)
        assert stored is not None and stored.rollout_id == later.rollout_id
    else:  # the later delivery, still running, stores its own
        assert result.status == "failed" and "closed by a later delivery" in result.error
        assert stored is None


def test_a_process_agent_its_dead_worker_left_running_is_stopped_by_the_next_delivery(
        redis_client, group):
    """The worker's ``finally`` (which kills the agent's group) never ran: the agent, in a
    session of its own, ran on past its timeout. The later delivery on the same host finds
    its process group in the rollout record and kills it, once it is sure the pid is still
    that agent's."""
    import os
    import signal

    from workers.rollout.controller import ProcessController, _start_ticks

    make_group(redis_client, group, "controller.agent=echo 0.5")  # the redelivery's agent
    rid, token = _start_attempt(redis_client, RUN, group, 0, 1)
    proc = _run_agent_like_a_dead_worker(redis_client, rid, token)
    try:
        record = redis_client.hgetall(keys.rollout(rid))
        assert int(record["agent_pid"]) == proc.pid
        assert record["agent_started"] == _start_ticks(proc.pid)
        # a record whose start time does not match is another process's pid: left alone
        redis_client.hset(keys.rollout(rid), "agent_started", "1")
        ProcessController("sleep 60", {}, redis_client).stop(rid)
        with pytest.raises(subprocess.TimeoutExpired):  # poll() alone misses a kill in flight
            proc.wait(1.0)
        redis_client.hset(keys.rollout(rid), "agent_started", record["agent_started"])
        result = run_sibling(redis_client, group, 0)  # the redelivery: closes and stops it
        assert proc.wait(10) == -signal.SIGKILL
        assert status(redis_client, rid) == "lost"
        assert result.status == "ok" and result.rollout_id != rid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _run_agent_like_a_dead_worker(client, rid: str, token: str):
    """Start the agent as the process controller does (its own session, recorded), from a
    worker whose process then 'dies': nothing watches or kills it."""
    import subprocess

    from workers.rollout.controller import ProcessController

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ProcessController("sleep 60", {}, client)._record(rid, proc.pid)
    client.hset(keys.rollout(rid), "worker", "gone-host:1:dead")  # its alive key is gone
    return proc

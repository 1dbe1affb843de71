"""Controllers without services: what counts as a reward, and how every kind of bad agent
fails its attempt with the reason (and stderr) visible."""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest

from workers.rollout.controller import (
    AgentError,
    LLMEndpoint,
    PauseAwareClock,
    ProcessController,
    PythonController,
    parse_reward,
)

LLM = LLMEndpoint("http://127.0.0.1:1/rollout/r/v1", "tok", "m", "g.0.ab")


def clock(paused=lambda: False) -> PauseAwareClock:
    return PauseAwareClock(paused)


def run_process(cmd: str, timeout: float = 10.0, **kw):
    return ProcessController(cmd, {}).run({"text": "abc"}, LLM, timeout, clock(**kw),
                                          lambda: False)


@pytest.mark.parametrize("value,expected", [(1, 1.0), (0.25, 0.25), ({"reward": -2}, -2.0)])
def test_parse_reward_accepts_numbers(value, expected):
    assert parse_reward(value) == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5", None, True, [1], {"r": 1}])
def test_parse_reward_rejects_the_rest(value):
    with pytest.raises(AgentError):
        parse_reward(value)


def test_process_agent_gets_endpoint_and_sample_and_returns_last_json_line():
    cmd = ("python3 -c \"import json,os,sys; s=json.loads(sys.stdin.readline()); "
           "assert os.environ['OPENAI_BASE_URL'].endswith('/v1'); "
           "assert os.environ['OPENAI_API_KEY']=='tok'; "
           "print('log line'); print(json.dumps({'reward': len(s['text'])/4}))\"")
    assert run_process(cmd) == 0.75


@pytest.mark.parametrize("cmd,fragment", [
    ("echo oops >&2; exit 3", "exited with code 3"),
    ("echo 'not json at all'", "not JSON"),
    ("true", "without printing a reward"),
    ("echo NaN", "non-finite"),
    ("echo '\"high\"'", "non-numeric"),
])
def test_bad_process_agents_fail_their_attempt(cmd, fragment):
    with pytest.raises(AgentError) as info:
        run_process(cmd)
    assert fragment in str(info.value)
    if "exit 3" in cmd:
        assert "oops" in info.value.stderr_tail


def test_hanging_process_agent_is_killed_with_its_children(tmp_path):
    # The agent's shell leads its own process group (the controller starts a new session);
    # it writes that group id first, so the check sees only this agent's children, never
    # another process on the machine that happens to run the same command.
    pgid_file = tmp_path / "pgid"
    start = time.monotonic()
    with pytest.raises(AgentError, match="timed out"):
        run_process(f"echo $$ > {pgid_file}; sleep 60 & sleep 60; wait", timeout=1.0)
    assert time.monotonic() - start < 5
    pgid = int(pgid_file.read_text())
    time.sleep(0.3)
    left = []
    for p in psutil.process_iter(["status"]):
        # a killed child that nobody has reaped yet is a zombie: dead, only not waited for
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except ProcessLookupError:
            continue
    assert left == []


def test_time_paused_does_not_count_against_the_timeout():
    # paused for the whole run: a 1 s timeout never fires while the agent takes 1.5 s
    assert run_process("sleep 1.5; echo 1", timeout=1.0, paused=lambda: True) == 1.0


def test_python_agent_errors_and_bad_rewards():
    with pytest.raises(AgentError, match="cannot be loaded"):
        PythonController("no.such.module:run", {})
    ctl = PythonController("tests.unit.test_controller:_raising_agent", {})
    with pytest.raises(AgentError, match="agent raised ValueError: boom"):
        ctl.run({}, LLM, 5, clock(), lambda: False)
    ctl = PythonController("tests.unit.test_controller:_nan_agent", {})
    with pytest.raises(AgentError, match="non-finite"):
        ctl.run({}, LLM, 5, clock(), lambda: False)
    ctl = PythonController("tests.unit.test_controller:_slow_agent", {})
    with pytest.raises(AgentError, match="timed out"):
        ctl.run({}, LLM, 0.5, clock(), lambda: False)


def _raising_agent(sample, llm):
    raise ValueError("boom")


def _nan_agent(sample, llm):
    return float("nan")


def _slow_agent(sample, llm):
    time.sleep(3)
    return 1.0


def test_posted_reward_wins_over_stdout():
    ctl = ProcessController("echo 0.1", {})
    assert ctl.run({}, LLM, 5, clock(), lambda: False, posted_reward=lambda: 0.9) == 0.9
    ctl = ProcessController("true", {})
    assert ctl.run({}, LLM, 5, clock(), lambda: False, posted_reward=lambda: 1) == 1.0

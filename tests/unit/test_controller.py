"""Controllers without services: what counts as a reward, and how every kind of bad agent
fails its attempt with the reason (and stderr) visible."""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest

from app.state.records import MAX_ABS_REWARD
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


def test_numpy_rewards_are_numbers_and_numpy_booleans_are_not():
    import numpy as np

    assert parse_reward(np.float32(0.5)) == 0.5 and parse_reward(np.int64(2)) == 2.0
    assert type(parse_reward(np.float64(1.0))) is float
    with pytest.raises(AgentError, match="non-numeric"):
        parse_reward(np.bool_(True))


def test_a_rollouts_token_never_shows_in_its_endpoints_repr():
    assert "tok" not in repr(LLM) and "api_key" not in repr(LLM)
    assert LLM.api_key == "tok"


def test_a_process_agent_gets_none_of_the_workers_secrets(monkeypatch):
    for name in ("REDIS_URL", "REDIS_PASSWORD", "CARRYOVER_ADMIN_TOKEN",
                 "CARRYOVER_INFERENCE_API_KEY"):
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("CARRYOVER_TEST_PLAIN", "kept")
    cmd = ("python3 -c \"import os; leaked = [k for k in ('REDIS_URL', 'REDIS_PASSWORD', "
           "'CARRYOVER_ADMIN_TOKEN', 'CARRYOVER_INFERENCE_API_KEY') if k in os.environ]; "
           "print(0 if leaked or os.environ.get('CARRYOVER_TEST_PLAIN') != 'kept' else 1)\"")
    assert run_process(cmd) == 1


def test_a_python_agents_error_message_is_bounded():
    import sys
    import types

    mod = types.ModuleType("carryover_test_loud_agent")

    def loud(sample, llm, **settings):
        raise RuntimeError("x" * 100_000)

    mod.loud = loud
    sys.modules[mod.__name__] = mod
    try:
        with pytest.raises(AgentError) as info:
            PythonController(f"{mod.__name__}:loud", {}).run(
                {}, LLM, 10.0, clock(), lambda: False)
    finally:
        del sys.modules[mod.__name__]
    assert len(str(info.value)) < 2100 and "RuntimeError" in str(info.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5", None, True, [1], {"r": 1},
                                   pytest.param(10**400, id="int-past-float"), 1e30, -2e9,
                                   {"reward": 10**10}])
def test_parse_reward_rejects_the_rest(value):
    # an int past float range, and magnitudes whose float32 square overflows a group's spread
    with pytest.raises(AgentError):
        parse_reward(value)


def test_the_largest_reward_accepted():
    assert parse_reward(MAX_ABS_REWARD) == MAX_ABS_REWARD
    assert parse_reward(-MAX_ABS_REWARD) == -MAX_ABS_REWARD


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
    # past the parser's own limits: an int of more digits than Python converts, deep nesting
    ("python3 -c \"print('9' * 5000)\"", "not JSON"),
    ("python3 -c \"print('[' * 100000)\"", "not JSON"),
])
def test_bad_process_agents_fail_their_attempt(cmd, fragment):
    with pytest.raises(AgentError) as info:
        run_process(cmd)
    assert fragment in str(info.value)
    if "exit 3" in cmd:
        assert "oops" in info.value.stderr_tail


def _left_in_group(pgid: int, wait_s: float = 10.0) -> list[int]:
    """The live processes of process group ``pgid`` once it has emptied, or those left
    after ``wait_s`` (a killed child not yet scheduled still shows as running; one that
    nobody has reaped yet is a zombie: dead, only not waited for)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
            except ProcessLookupError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_hanging_process_agent_is_killed_with_its_children(tmp_path):
    # The agent's shell leads its own process group (the controller starts a new session);
    # it writes that group id first, so the check sees only this agent's children, never
    # another process on the machine that happens to run the same command.
    pgid_file = tmp_path / "pgid"
    start = time.monotonic()
    with pytest.raises(AgentError, match="timed out"):
        run_process(f"echo $$ > {pgid_file}; sleep 60 & sleep 60; wait", timeout=1.0)
    assert time.monotonic() - start < 30  # its timeout, not the agent's minute
    assert _left_in_group(int(pgid_file.read_text())) == []


def test_children_an_agent_leaves_behind_are_killed_when_it_exits(tmp_path):
    # the background sleep also holds the agent's stdout open: the reward must still come
    # back at once
    pgid_file = tmp_path / "pgid"
    start = time.monotonic()
    assert run_process(f"echo $$ > {pgid_file}; sleep 60 & echo 1") == 1.0
    assert time.monotonic() - start < 30  # at once, not after the child's minute
    assert _left_in_group(int(pgid_file.read_text())) == []


def test_a_process_that_escaped_the_group_leaves_no_reader_behind(tmp_path):
    """A daemon the agent started in a session of its own keeps the agent's stdout and
    stderr open: killing the group does not reach it. The pipe readers stop and close
    their fds instead of staying blocked for the daemon's life (2 threads and 2 fds per
    such attempt, in a worker that runs for weeks)."""
    import threading

    from workers.rollout.controller import _Tail

    def readers() -> int:  # counted by name: other tests' daemon threads come and go
        return sum(t.name == _Tail.THREAD_NAME for t in threading.enumerate())

    def pipes() -> int:  # the agent's stdout and stderr pipes, not other tests' sockets
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
            except OSError:  # closed since the listing
                pass
        return count

    marker = f"escaped-{tmp_path.name}"
    pipes_before, readers_before = pipes(), readers()  # an earlier test's may be winding down
    try:
        assert run_process(f"setsid sh -c 'sleep 60; echo {marker}' & sleep 1; echo 1") == 1.0
        deadline = time.monotonic() + 5
        while readers() > readers_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert readers() <= readers_before
        assert pipes() <= pipes_before
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            if marker in " ".join(proc.info["cmdline"] or []):
                for child in proc.children(recursive=True):  # its sleep
                    child.kill()
                proc.kill()


def _in_thread(fn, limit_s: float):
    """fn()'s result or exception, failing the test if it has not returned in ``limit_s``."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still running after {limit_s} s"
    return box


def test_a_sample_the_agent_never_reads_does_not_block_its_timeout():
    # 90 KB: more than a pipe holds, small enough for the environment
    ctl = ProcessController("sleep 30", {})
    box = _in_thread(lambda: ctl.run({"text": "x" * 90_000}, LLM, 1.0, clock(),
                                     lambda: False), 15)
    assert isinstance(box.get("error"), AgentError) and "timed out" in str(box["error"])


def test_a_sample_too_large_for_the_environment_comes_on_stdin():
    cmd = ("python3 -c \"import json,os,sys; s=json.loads(sys.stdin.readline()); "
           "print(len(s['text']) / 1e6 + ('CARRYOVER_SAMPLE' in os.environ))\"")
    ctl = ProcessController(cmd, {})
    assert ctl.run({"text": "x" * 1_000_000}, LLM, 20, clock(), lambda: False) == 1.0
    assert ctl.run({"text": "x" * 1000}, LLM, 20, clock(), lambda: False) == 1.001


def test_an_agent_that_logs_a_lot_does_not_fill_the_worker():
    import tracemalloc

    # 40 MB on one line of stdout and on stderr, then the reward
    cmd = ("head -c 40000000 /dev/zero | tr '\\0' x; head -c 40000000 /dev/zero >&2; "
           "echo; echo 0.5")
    tracemalloc.start()
    try:
        assert run_process(cmd, timeout=60) == 0.5
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8_000_000, f"{peak / 1e6:.1f} MB held for the agent's output"


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

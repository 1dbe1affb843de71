"""The suite's temporary directory (its Redis data, its services' logs): removed after a
passing run, kept after a failing one that started something."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# small test files of the suite: one starts Redis, one starts nothing
WITH_REDIS = "tests/unit/test_step_memo.py"
NO_SERVICE = "tests/unit/test_free_port.py"
# a plugin that fails every test it runs
FAIL_EVERY_TEST = "def pytest_runtest_call(item):\n    raise AssertionError('made to fail')\n"


# make test's two workers, one per group of tests (tests/conftest.py)
TWO_WORKERS = ("-n", "2", "--dist", "loadgroup")


def _env(tmp_path: Path) -> dict[str, str]:
    """The environment of a pytest run inside this test: its temp directory under
    ``tmp_path``, plugins importable from there, and not the options of the pytest running
    this test (a report file it writes, say)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
            "TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def _pytest(tmp_path: Path, *targets: str, fail: bool = False,
            options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    (tmp_path / "fail_every_test.py").write_text(FAIL_EVERY_TEST)
    plugin = ["-p", "fail_every_test"] if fail else []
    out = subprocess.run(_command(*plugin, *options, *targets), cwd=REPO, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == (1 if fail else 0), out.stdout + out.stderr
    return out


def _left(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("carryover-test-*"))


def test_a_passing_run_leaves_no_directory(tmp_path):
    _pytest(tmp_path, WITH_REDIS)
    assert _left(tmp_path) == []


def test_a_failing_run_keeps_its_logs_and_says_where(tmp_path):
    out = _pytest(tmp_path, WITH_REDIS, fail=True)
    [kept] = _left(tmp_path)
    assert (kept / "logs" / "redis.log").is_file()
    assert f"services' logs kept in {kept / 'logs'}" in out.stdout


def test_a_failing_run_that_started_nothing_leaves_nothing(tmp_path):
    out = _pytest(tmp_path, NO_SERVICE, fail=True)
    assert _left(tmp_path) == []
    assert "logs kept" not in out.stdout


def test_a_run_that_never_starts_its_session_leaves_nothing(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _left(tmp_path) == []


def test_a_process_that_only_imports_the_conftest_leaves_nothing(tmp_path):
    # as a test module's spawned subprocess or Ray worker does
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "import tests.conftest"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _left(tmp_path) == []


# one small test file in each of make test's two worker groups (tests/conftest.py), each
# starting Redis: the second group takes the unit tests, the first the integration ones
TWO_GROUPS = ["tests/unit/test_step_memo.py", "tests/integration/test_carry_counts.py"]


def test_under_two_workers_a_failing_run_names_each_workers_kept_logs(tmp_path):
    out = _pytest(tmp_path, *TWO_GROUPS, fail=True, options=TWO_WORKERS)
    kept = [p for p in _left(tmp_path) if (p / "logs" / "redis.log").is_file()]
    assert len(kept) == 2, (_left(tmp_path), out.stdout)  # one per worker
    for directory in kept:
        assert f"services' logs kept in {directory / 'logs'}" in out.stdout


# Each test waits to be stopped; each worker's session ends with a teardown longer than the
# 10 s pytest-xdist gives an interrupted worker before it kills it.
SLOW_TEARDOWN = """
import os, time
from pathlib import Path
import pytest

OUT = Path(os.environ["PROBE_OUT"])

@pytest.fixture(autouse=True, scope="session")
def _slow_teardown():
    yield
    time.sleep(15)
    (OUT / f"torn-down-{os.getpid()}").write_text("")

def pytest_runtest_call(item):
    (OUT / f"running-{os.getpid()}").write_text("")
    time.sleep(300)
"""


def test_a_terminated_two_worker_run_lets_each_worker_tear_down(tmp_path):
    import signal
    import time

    (tmp_path / "slow_teardown.py").write_text(SLOW_TEARDOWN)
    proc = subprocess.Popen(_command("-p", "slow_teardown", *TWO_WORKERS, *TWO_GROUPS),
                            cwd=REPO, env={**_env(tmp_path), "PROBE_OUT": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("running-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the tests never ran"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # as `timeout` or a CI runner stops a run
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert len(list(tmp_path.glob("torn-down-*"))) == 2, out
    assert proc.returncode != 0

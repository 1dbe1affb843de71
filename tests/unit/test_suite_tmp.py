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


def _pytest(tmp_path: Path, target: str, fail: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "fail_every_test.py").write_text(FAIL_EVERY_TEST)
    # not the options of the pytest running this test (a report file it writes, say)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
           "TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    plugin = ["-p", "fail_every_test"] if fail else []
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *plugin, target], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
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

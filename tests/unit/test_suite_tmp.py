"""The suite's temporary directory (its Redis data, its services' logs): removed after a
passing run, kept after a failing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a small test file of the suite that starts no service
TARGET = "tests/unit/test_free_port.py"


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args, TARGET], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def _left(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("carryover-test-*"))


def test_a_passing_run_leaves_no_directory(tmp_path):
    out = _pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _left(tmp_path) == []


def test_a_failing_run_keeps_its_logs_and_says_where(tmp_path):
    # a plugin that fails every test it runs
    (tmp_path / "fail_every_test.py").write_text(
        "def pytest_runtest_call(item):\n    raise AssertionError('made to fail')\n")
    out = _pytest(tmp_path, "-p", "fail_every_test")
    assert out.returncode == 1, out.stdout + out.stderr
    [kept] = _left(tmp_path)
    assert f"services' logs kept in {kept / 'logs'}" in out.stdout

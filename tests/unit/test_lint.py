"""The code base stays ruff-clean."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]

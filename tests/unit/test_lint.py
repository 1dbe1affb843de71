"""The code base stays ruff-clean."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_mypy_clean():
    """The type check of ``make lint`` ([tool.mypy] in pyproject.toml says what it covers)."""
    mypy = Path(sys.executable).parent / "mypy"
    out = subprocess.run([str(mypy)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]


# The repository describes the software, not the story of its making: the history of
# attempts belongs in commit messages.
HISTORY = [r"\b(this|that|earlier|previous|next|in) session\b", r"\bsession \d+\b",
           r"\bhow it got here\b", r"\bissue #?\d+\b", r"\btickets?\b", r"\bwork periods?\b",
           r"\btried (before )?and (dropped|kept out)\b"]


def test_no_history_in_tracked_files():
    import re

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    pattern = re.compile("|".join(HISTORY), re.I)
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", "") \
                or not path.is_file() or name.endswith("test_lint.py"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)

"""The tiny model's demo end to end through every real process, shortened to a few steps.
It must finish, log every step's metrics under their exact names, draw a valid PNG, carry at
least one group over a step, and leave no process running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.driver.metrics import CARRY_METRICS
from tests.conftest import REPO, stack_overrides

pytestmark = pytest.mark.slow


def test_short_demo_runs_end_to_end(tmp_path):
    overrides = stack_overrides(tmp_path) + [
        f"logging.dir={tmp_path / 'runs'}", f"trainer.weights_dir={tmp_path / 'weights'}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "services.rollout_concurrency=32"]
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides), "WANDB_MODE": "offline"}
    env.pop("CARRYOVER_CONFIG", None)
    marker = env["CARRYOVER_OVERRIDES"]
    out = subprocess.run([str(Path(sys.executable).parent / "carryover"), "demo",
                          "--config", "config/demo.yaml", "--steps", "4"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "reward_last_5" in out.stdout  # the summary table
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for name in CARRY_METRICS:
            assert name in r and r[name] is not None, name
        assert 0.0 <= r["reward/mean"] <= 1.0
    assert any(r["training/async/n_new_carry_over_rollouts"] > 0 for r in rows[:-1])
    assert any(r["training/async/n_prev_carry_over_rollouts"] > 0 for r in rows[1:])
    png = (run_dir / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert list(run_dir.glob("wandb/offline-run-*")), "no W&B offline run written"
    # nothing left running
    deadline = time.monotonic() + 10
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("CARRYOVER_OVERRIDES") == marker:
                    left.append((p.pid, " ".join(p.cmdline())[:80]))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []

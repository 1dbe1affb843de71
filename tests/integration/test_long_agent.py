"""The main demo's task for a few steps, both modes, through every real process: the
long-running agent (a slow, heavy-tailed test suite after each answer) on
SmolLM2-135M-Instruct, as ``make demo ARGS=--compare`` runs it with its tool shortened.
The asynchronous run must carry unfinished groups over to later steps, the synchronous one
never, and the comparison's time-to-accuracy table and plot must come out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SMOLLM2, stack_overrides

pytestmark = pytest.mark.slow
CARRY = "training/async/"


def test_the_long_agent_trains_in_both_modes_and_carries_over_when_asynchronous(tmp_path):
    assert (SMOLLM2 / "carryover-build.json").exists(), "scripts/setup.sh builds the model"
    val = tmp_path / "val.jsonl"
    held_out = (REPO / "examples" / "arith" / "data" / "val.jsonl").read_text().splitlines()
    val.write_text("\n".join(held_out[:4]) + "\n")
    overrides = stack_overrides(tmp_path) + [
        f"logging.dir={tmp_path / 'runs'}", f"trainer.weights_dir={tmp_path / 'weights'}",
        f"data.val_files={val}", "trainer.test_freq=3",  # before training and after the last
        # two groups of four per update, four in flight: a short suite with the same tail
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "agent.suite_median_s=2", "agent.suite_max_s=12"]
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides), "WANDB_MODE": "offline"}
    env.pop("CARRYOVER_CONFIG", None)
    out = subprocess.run([str(Path(sys.executable).parent / "carryover"), "demo", "--compare",
                          "--steps", "3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "minutes_to_threshold" in out.stdout and "held-out success threshold" in out.stdout
    ids = dict(re.findall(r"\n(async|sync): run (\S+)", out.stdout))
    assert set(ids) == {"async", "sync"}, out.stdout[-2000:]
    runs = {}
    for mode, run_id in ids.items():
        run_dir = tmp_path / "runs" / run_id
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "val/success_rate" not in r]
        evals = [r for r in rows if "val/success_rate" in r]
        assert [r["step"] for r in steps] == [0, 1, 2]
        assert len(evals) == 2  # before training and after the last update
        assert all(0.0 <= e["val/success_rate"] <= 1.0 for e in evals)
        runs[mode] = (run_dir, steps)
    assert set(runs) == {"async", "sync"}
    _, steps = runs["async"]
    assert any(r[CARRY + "n_new_carry_over_rollouts"] > 0 for r in steps[:-1])
    assert any(r[CARRY + "n_prev_carry_over_rollouts"] > 0 for r in steps[1:])
    _, steps = runs["sync"]
    assert all(r[CARRY + "n_new_carry_over_rollouts"] == 0 for r in steps)
    for run_dir, _ in runs.values():
        assert (run_dir / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = [p for p in (tmp_path / "runs").glob("*/time-to-accuracy.png")]
    assert len(png) == 1 and png[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

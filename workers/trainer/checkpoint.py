"""Trainer checkpoints: the engine's sharded model and optimizer state (verl's FSDP
checkpoint manager, one shard per rank), the controller's RNG, step, policy version and a
snapshot of the run's state, so a resumed run continues from the same parameters.

Layout: ``<checkpoint_dir>/<run_id>/step_<k>/{engine/, rng.pt, meta.json}``; written to a
temporary directory and renamed, so a crash never leaves a half checkpoint that looks
complete (``meta.json`` is written last).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


def save_checkpoint(trainer: Any, root: Path, run_id: str, step: int, version: int,
                    run_state: dict, keep: int = 2) -> Path:
    run_dir = root / run_id
    out = run_dir / f"step_{step:06d}"
    tmp = run_dir / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save(tmp / "engine")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()}, tmp / "rng.pt")
    (tmp / "meta.json").write_text(json.dumps(
        {"run_id": run_id, "step": step, "policy_version": version, "run_state": run_state},
        indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    for old in sorted(p for p in run_dir.iterdir() if p.name.startswith("step_"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def latest_checkpoint(root: Path, run_id: str) -> Path | None:
    run_dir = root / run_id
    if not run_dir.is_dir():
        return None
    done = sorted(p for p in run_dir.iterdir()
                  if p.name.startswith("step_") and (p / "meta.json").exists())
    return done[-1] if done else None


def load_checkpoint(trainer: Any, path: Path) -> dict:
    trainer.load(path / "engine")
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return json.loads((path / "meta.json").read_text())

"""A checkpoint round trip restores bit-identical parameters and optimizer state."""

from __future__ import annotations

import torch

from app.config import load_config
from app.config.loader import REPO_ROOT
from workers.trainer.batch import Sample, to_batch
from workers.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from workers.trainer.update import PolicyTrainer

MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")


def batch():
    samples = [Sample([1, 3, 4], [5, 6, 2], [-3.0, -3.1, -3.2], float(i % 2), f"g{i // 2}",
                      1.0, 0) for i in range(4)]
    return to_batch(samples, 0)


def test_round_trip_is_bit_identical(tmp_path):
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=null"])
    a = PolicyTrainer(cfg, MODEL)
    a.update(batch())
    save_checkpoint(a, tmp_path, "run", 1, 3, {"step": "1"})
    b = PolicyTrainer(cfg, MODEL)
    assert any(not torch.equal(x, y) for x, y in zip(a.model.parameters(),
                                                      b.model.parameters(), strict=True))
    meta = load_checkpoint(b, latest_checkpoint(tmp_path, "run"))
    assert meta["step"] == 1 and meta["policy_version"] == 3
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(x, y)
    # the optimizer state came back too: the next update is identical on both
    a.update(batch())
    b.update(batch())
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(x, y)

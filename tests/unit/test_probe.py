"""The weight-sync probe: a non-finite gap fails the sync, and scoring the reference model in
the engine's dtype never rounds its master weights."""

from __future__ import annotations

import pytest
import torch

from app.config import load_config
from app.config.loader import REPO_ROOT
from bench.reference import PolicyTrainer
from workers.trainer import weights

MODEL = REPO_ROOT / "var" / "models" / "tiny-qwen2"


def test_a_nan_probe_gap_fails_the_sync(monkeypatch):
    ids = weights.PROBE_IDS
    monkeypatch.setattr(weights, "engine_probe_logprobs",
                        lambda url, name, ids, dp_rank=None: [float("nan")] * (len(ids) - 1))
    with pytest.raises(weights.WeightSyncError, match="non-finite"):
        weights.verify_sync("http://x", "m", [-1.0] * (len(ids) - 1), None, 0.01, ids)


def test_every_data_parallel_replica_is_probed(monkeypatch):
    """Each replica of a data-parallel server holds its own copy of the weights, and the
    server's balancer sends one probe to one of them: each is asked by name."""
    ids = weights.PROBE_IDS
    asked = []

    def probe(url, name, ids, dp_rank=None):
        asked.append(dp_rank)
        return [-1.0 if dp_rank != 2 else -3.0] * (len(ids) - 1)  # replica 2 kept old weights

    monkeypatch.setattr(weights, "engine_probe_logprobs", probe)
    expected = [-1.0] * (len(ids) - 1)
    assert weights.verify_sync("http://x", "m", expected, None, 0.01, ids, dp_size=2) == \
        {"weight_sync/probe_gap": 0.0}
    assert asked == [0, 1]
    with pytest.raises(weights.WeightSyncError, match="data-parallel replica 2"):
        weights.verify_sync("http://x", "m", expected, None, 0.01, ids, dp_size=4)


def test_bf16_probe_leaves_the_fp32_weights_unrounded():
    trainer = PolicyTrainer(load_config(None, ["trainer.device=cpu"]), str(MODEL))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1e-6)  # below bf16's resolution: rounding would erase it
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weights.trainer_probe_logprobs(trainer.model, weights.PROBE_IDS, torch.bfloat16)
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_auto_dtype_is_the_one_vllm_serves(tmp_path):
    """vLLM serves a float32 checkpoint with dtype auto in bfloat16 here: the weights
    went in float32, twice the bytes, buckets and shared memory the server needed."""
    import json
    import shutil
    import subprocess

    half = tmp_path / "half"  # a checkpoint that says float16 keeps it
    half.mkdir()
    shutil.copy(MODEL / "config.json", half / "config.json")
    hf = json.loads((half / "config.json").read_text())
    (half / "config.json").write_text(json.dumps({**hf, "dtype": "float16"}))
    code = ("import sys\nfrom vllm.config import ModelConfig\n"
            "for m in sys.argv[1:]:\n    print(ModelConfig(model=m, dtype='auto').dtype)\n")
    out = subprocess.run([str(REPO_ROOT / ".venv-vllm/bin/python"), "-c", code, str(MODEL),
                          str(half)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    served = out.stdout.split()[-2:]
    assert served == ["torch.bfloat16", "torch.float16"]  # the tiny model is fp32
    assert [str(weights.engine_dtype("auto", m)) for m in (MODEL, half)] == served
    assert weights.engine_dtype("float32", MODEL) == torch.float32

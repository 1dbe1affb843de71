"""Weight sync against the real vLLM server: after a reload the engine's log-probs for a fixed
sequence match the trainer's new weights and differ from the previous ones; an engine that
missed the reload is caught by the probe."""

from __future__ import annotations

import pytest
import torch

from app.config.loader import REPO_ROOT
from bench.reference import PolicyTrainer
from workers.trainer import weights

MODEL = REPO_ROOT / "var" / "models" / "tiny-qwen2"


def test_reload_applies_and_a_stale_engine_is_caught(vllm_service, cfg, tmp_path):
    url, name = vllm_service, cfg.inference.served_model_name
    trainer = PolicyTrainer(cfg, str(MODEL))
    dtype = weights.engine_dtype(cfg.inference.dtype)
    try:
        path = weights.save_weights(trainer.model, tmp_path, 1, keep=2)
        weights.reload_weights(url, path)
        before = weights.trainer_probe_logprobs(trainer.model, weights.PROBE_IDS, dtype)
        assert weights.verify_sync(url, name, before, None, 1e-4)["weight_sync/probe_gap"] < 1e-4

        with torch.no_grad():  # a visible change of the policy
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        after = weights.trainer_probe_logprobs(trainer.model, weights.PROBE_IDS, dtype)
        assert weights.mean_gap(before, after) > 1e-2

        # not reloaded yet: the engine still serves the old weights and the probe says so
        with pytest.raises(weights.WeightSyncError):
            weights.verify_sync(url, name, after, before, 1e-4)

        path = weights.save_weights(trainer.model, tmp_path, 2, keep=2)
        weights.reload_weights(url, path, version=2)
        # the server keeps the version it was given (the upstream keeper reads it back)
        assert weights.loaded_version(url) == "2"
        m = weights.verify_sync(url, name, after, before, 1e-4)
        assert m["weight_sync/probe_gap"] < 1e-4
        assert m["weight_sync/probe_gap_to_previous"] > 1e-2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001", "v000002"]
    finally:
        weights.reload_weights(url, MODEL, version=0)  # leave the engine on the base model

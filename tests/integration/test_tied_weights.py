"""A model with tied input and output embeddings (as Qwen2.5 0.5B-3B and Llama 3.2 ship)
trains on the engine, exports, reloads into the real vLLM server and passes the probe: the
server's output head follows the trained embeddings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.config import load_config
from tests.conftest import model_server
from workers.trainer import weights
from workers.trainer.batch import Sample
from workers.trainer.engine import EngineTrainer
from workers.trainer.verl_batch import to_verl_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tied"
    subprocess.run([sys.executable, "scripts/build_model.py", "--out", str(out), "--tied"],
                   check=True, capture_output=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    return out


@pytest.fixture(scope="module")
def tied_server(tied_model, tmp_path_factory):
    with model_server(tied_model, "tied", tmp_path_factory.mktemp("logs")) as url:
        yield url


def test_tied_embeddings_train_reload_and_pass_the_probe(tied_model, tied_server, tmp_path):
    cfg = load_config(None, ["trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-2"])
    trainer = EngineTrainer(cfg, str(tied_model))
    exported = trainer.full_weights()
    assert "lm_head.weight" in exported  # written out explicitly, whatever the server skips
    ids = weights.probe_ids(tied_model)
    before = trainer.probe_log_probs(ids)
    assert weights.verify_sync(tied_server, "tied", before, None, 1e-4, ids)[
        "weight_sync/probe_gap"] < 1e-4
    batch = [Sample([1, 3, 4, 5], [6, 7, 8, 2], [-3.0] * 4, float(i % 2), "g0", 1.0, 0)
             for i in range(4)]
    for step in range(3):
        trainer.update(to_verl_batch(batch, 0), step)
    after = trainer.probe_log_probs(ids)
    assert weights.mean_gap(before, after) > 1e-2
    path = weights.publish_version(tmp_path, 1, 2, lambda d: trainer.export_weights(d, "float32"))
    weights.reload_weights(tied_server, path)
    m = weights.verify_sync(tied_server, "tied", after, before, 1e-4, ids)
    assert m["weight_sync/probe_gap"] < 1e-4
    assert m["weight_sync/probe_gap_to_previous"] > 1e-2

"""A model with tied input and output embeddings (as Qwen2.5 0.5B-3B and Llama 3.2 ship)
trains on the engine, exports, reloads into the real vLLM server and passes the probe: the
server's output head follows the trained embeddings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from app.config import load_config
from app.services.commands import inference_command
from tests.conftest import free_port
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
    port = free_port()
    cfg = load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                             f"actor_rollout_ref.model.path={tied_model}",
                             f"inference.port={port}", "inference.served_model_name=tied"])
    cmd = inference_command(cfg)
    log = tmp_path_factory.mktemp("logs") / "vllm-tied.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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

"""LoRA training of the real model through the whole stack: SmolLM2-135M-Instruct with a
rank-8 adapter on verl's FSDP2 engine (peft), each update's adapter alone exported and loaded
into the real vLLM CPU server under its own name (the base weights untouched), the gateway
sending agents' calls to the newest adapter, the probe proving each version against the
trainer's adapted model, and the adapters before the previous one unloaded."""

from __future__ import annotations

import json
import os

import pytest
import requests

from app.config import load_config
from app.config.secrets import inference_api_key
from app.driver.loop import train
from tests.conftest import SMOLLM2 as MODEL
from tests.conftest import SMOLLM2_NAME as NAME
from tests.conftest import SMOLLM2_SERVING as SERVING
from tests.conftest import gateway_process, model_server
from workers.trainer import weights

pytestmark = pytest.mark.slow

LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")


@pytest.fixture(scope="module")
def lora_stack(tmp_root, redis_service, celery_workers):
    with model_server(MODEL, NAME, tmp_root / "logs", *SERVING, *LORA) as url, \
            gateway_process(tmp_root, "gateway-lora", [url], f"inference.served_model_name={NAME}",
                            f"actor_rollout_ref.model.path={MODEL}", *SERVING, *LORA,
                            "actor_rollout_ref.rollout.max_tokens=12") as (gateway, _):
        yield url, gateway


def test_three_lora_steps_of_the_real_model(lora_stack, tmp_path, new_rollout):
    url, gateway = lora_stack
    cfg = load_config("config/arith.yaml", [
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]), *SERVING, *LORA,
        f"inference.urls=[{url}]", f"gateway.url={gateway}",
        "trainer.total_steps=3", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "agentlightning.async_rollout.async_train_batch_size=3",
        # LoRA takes a larger step than full fine-tuning (its B starts at zero)
        "actor_rollout_ref.actor.lr=5e-3",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "controller.agent=tests.agents:arith_graded", "agent.tool_median_s=0.05",
        # no held-out evaluations (the arithmetic example's two took a quarter of the test)
        "data.val_files=null", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}"])
    weights.use_api_key(inference_api_key(cfg))
    ids = weights.probe_ids(MODEL)
    base_before = weights.engine_probe_logprobs(url, NAME, ids)
    steps: list[dict] = []
    result = train(cfg, on_step=lambda s, m: steps.append(m))
    assert result["steps"] == 3
    tolerance = float(cfg.trainer.probe_tolerance)
    for m in steps:
        # every rollout's calls reached the adapter of their version (one that was not
        # loaded is a failed call, and its group would be dropped and re-queued)
        assert m["batch/groups"] == 2 and m["batch/rollouts"] == 8
        assert m["training/async/n_dropped_groups"] == 0
        assert m["actor/grad_norm"] > 0 and m["batch/trained_tokens"] > 0
        # the probe asked the new version's adapter and found the trainer's adapted model
        assert m["weight_sync/probe_gap"] < tolerance
    # versions 1 (the run's start) to 4: each step unloaded the one before the previous
    assert [m["weight_sync/unloaded_adapters"] for m in steps] == [0, 1, 1]
    last = int(steps[-1]["policy/version"])
    served = sorted(weights.served_adapters(url, NAME), key=lambda n: int(n.rsplit("v", 1)[1]))
    assert served == [f"{NAME}-v{last - 1}", f"{NAME}-v{last}"]
    assert weights.loaded_version(url) == str(last)
    # the exports are adapters: megabytes, not the model's 270 MB
    exported = sorted((tmp_path / "weights").glob("v*/adapter_model.safetensors"))
    assert exported and all(f.stat().st_size < 20e6 for f in exported)
    # an agent's call now goes to the newest adapter, and the base model is as it started
    rid, token, base = new_rollout(gateway)
    answer = requests.post(f"{base}/chat/completions", headers={
        "Authorization": f"Bearer {token}"}, json={
        "model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "2+2?"}]},
        timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == f"{NAME}-v{last}"
    base_after = weights.engine_probe_logprobs(url, NAME, ids)
    adapted = weights.engine_probe_logprobs(url, f"{NAME}-v{last}", ids)
    assert weights.mean_gap(base_before, base_after) < 1e-6  # only adapters were loaded
    # the adapter moved the model by more than the probe's tolerance: the probe that passed
    # at each step told the trained adapter from the base
    assert weights.mean_gap(base_after, adapted) > tolerance

"""A real pretrained instruct model through the whole stack: SmolLM2-135M-Instruct (49,152
tokens, tied embeddings, ChatML template, EOS <|im_end|>) served by vLLM CPU in bf16, the
arithmetic chat conversation through the gateway, verl's FSDP2 engine, the bf16 weights sent
through vLLM's weight-transfer routes (weight_sync transfer; the reload from disk is the
default everywhere else), the probe and the checksums, and an evaluation before and during
training."""

from __future__ import annotations

import json
import os

import pytest
import requests

from app.config import load_config
from app.driver.loop import train
from app.state import keys
from app.state.records import CapturedCall
from tests.conftest import INFERENCE_AUTH, gateway_process
from tests.conftest import SMOLLM2 as MODEL
from tests.conftest import SMOLLM2_NAME as NAME
from tests.conftest import SMOLLM2_SERVING as SERVING
from tests.conftest import SMOLLM2_SESSION_SERVING as SESSION_SERVING

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_root, smollm2_server, celery_workers):
    url = smollm2_server
    with gateway_process(
            tmp_root, "gateway-smollm2", [url], f"inference.served_model_name={NAME}",
            # the context check counts with the served model's tokenizer and length
            f"actor_rollout_ref.model.path={MODEL}", *SESSION_SERVING,
            "actor_rollout_ref.rollout.max_tokens=12") as (gateway, _):
        yield url, gateway


def test_a_chat_turn_ends_at_the_end_of_turn_token(smol):
    url, _ = smol
    answer = requests.post(f"{url}/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 64, "temperature": 0, "return_token_ids": True}, timeout=120,
        headers=INFERENCE_AUTH).json()
    choice = answer["choices"][0]
    # the converted tokenizer named <|im_start|> (id 1) as EOS: a turn would run on into
    # the next one instead of stopping at <|im_end|> (id 2)
    assert choice["finish_reason"] == "stop", choice
    assert choice["token_ids"][-1] == 2 and 1 not in choice["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_an_n_2_call_is_captured(smol, new_rollout, redis_client, stream):
    _, gateway = smol
    rid, token, base = new_rollout(gateway)
    resp = requests.post(base + "/chat/completions", timeout=120, stream=stream,
                         headers={"Authorization": f"Bearer {token}"},
                         json={"model": NAME, "n": 2, "max_tokens": 12, "stream": stream,
                               "logprobs": True,
                               "messages": [{"role": "user", "content": "What is 3 + 4?"}]})
    assert resp.status_code == 200, resp.text
    # the log-probs the agent was sent, per choice, to compare with what was captured
    sent: dict[int, list[float]] = {0: [], 1: []}
    if stream:
        lines = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
        assert lines[-1] == b"data: [DONE]"
        for line in lines[:-1]:
            for choice in json.loads(line[6:]).get("choices", []):
                content = (choice.get("logprobs") or {}).get("content") or []
                sent[choice["index"]].extend(t["logprob"] for t in content)
    else:
        choices = resp.json()["choices"]
        assert len(choices) == 2
        for choice in choices:
            sent[choice["index"]] = [t["logprob"] for t in choice["logprobs"]["content"]]
    calls = [CapturedCall.from_json(c) for c in redis_client.lrange(keys.rollout_calls(rid),
                                                                      0, -1)]
    assert len(calls) == 2  # one sample per choice, each with its own tokens and log-probs
    for call in calls:
        assert call.response_ids and len(call.logprobs) == len(call.response_ids)
        assert call.nonfinite_logprobs == 0 and call.stream == stream
        assert all(lp is not None and lp <= 0 for lp in call.logprobs)
    assert calls[0].prompt_ids == calls[1].prompt_ids
    # each sample carries its own choice's log-probs, not one choice's twice (two different
    # tokens at one position can tie in bf16, so the samples are matched to what was sent)
    assert sorted(c.logprobs for c in calls) == sorted(sent.values())


def test_three_steps_of_the_real_model_through_every_part(smol, tmp_path):
    url, gateway = smol
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in ((2, 3), (4, 4))))
    cfg = load_config("config/arith.yaml", [
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]), *SERVING,
        f"inference.urls=[{url}]", f"gateway.url={gateway}",
        "trainer.total_steps=3", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "inference.weight_sync=transfer", "inference.transfer_bucket_mb=64",
        "agentlightning.async_rollout.async_train_batch_size=3",
        # a large step, so that each update moves the probe by more than the bf16 tolerance
        # and the probe must see the new weights, not the previous ones
        "actor_rollout_ref.actor.lr=5e-4",
        # dynamic sampling: only groups whose rewards differ are trained, so every update
        # has a gradient (a group of equal rewards has none); arith's reward is sparse for
        # this model (most groups all 0), partial credit makes most groups informative,
        # and a step that still starves fails naming its figures instead of waiting on
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "controller.agent=tests.agents:arith_graded",
        f"data.val_files={val}", "trainer.test_freq=2", "agent.tool_median_s=0.05",
        f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}"])
    steps: list[dict] = []
    evals: list[dict] = []
    result = train(cfg, on_step=lambda s, m: steps.append(m),
                   on_eval=lambda s, m: evals.append(m))
    assert result["steps"] == 3
    tolerance = float(cfg.trainer.probe_tolerance)
    for m in steps:
        assert m["batch/groups"] == 2 and m["batch/rollouts"] == 8
        assert m["weight_sync/probe_gap"] < tolerance
        assert m["batch/trained_tokens"] > 0
        assert m["actor/grad_norm"] > 0 and m["actor/advantage_abs_mean"] > 0, m
        # the update moved the probe by more than the tolerance: the check that the engine
        # is closer to the new weights than to the previous ones ran and passed (the tied
        # head included)
        assert m["weight_sync/probe_gap_to_previous"] > tolerance, m
        # sent by transfer, no export: every tensor in buckets, the digests checked
        assert "timing/trainer_save_seconds" not in m and m["timing/trainer_transfer_seconds"]
        assert m["weight_sync/bytes_moved"] >= 2 * 134_515_008 and m["weight_sync/buckets"] > 4
        assert m["weight_sync/checksummed_tensors"] > 0 and m["weight_sync/changed_tensors"] > 0
    # A second turn re-sends the conversation: it shares the first call's row when the
    # chat template renders the first answer back as the tokens sampled (BPE can sample a
    # word in pieces that re-tokenize as one: then the call takes a row of its own).
    for m in steps:
        assert m["batch/packed_calls"] <= m["batch/later_turn_calls"]
    later = sum(m["batch/later_turn_calls"] for m in steps)
    packed = sum(m["batch/packed_calls"] for m in steps)
    if later >= 4:  # second turns come only after a wrong first answer
        assert packed >= later / 2, (later, packed)
    assert [e["val/sent_at_step"] for e in evals] == [0.0, 2.0, 3.0]
    assert all(e["val/n_rollouts"] == 2 for e in evals)

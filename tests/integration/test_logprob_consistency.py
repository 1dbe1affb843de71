"""Rollout log-probs (vLLM, through the gateway) and trainer log-probs agree for the same
weights at a sampling temperature other than 1; scored at the wrong temperature they do not.
vLLM serves ``processed_logprobs`` and the trainer divides logits by the captured temperature."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest
import torch

from app.config.loader import REPO_ROOT
from app.state import keys
from app.state.records import CapturedCall
from bench.reference import PolicyTrainer, token_log_probs
from tests.conftest import standin_gateway
from workers.trainer import weights
from workers.trainer.batch import Sample, to_batch

MODEL = REPO_ROOT / "var" / "models" / "tiny-qwen2"


@pytest.fixture(scope="module")
def gateway_at_0_7(vllm_service, redis_service, tmp_root):
    """A gateway in front of the real vLLM server whose runs sample at temperature 0.7 (the
    gateway sets every call to the rollout temperature the trainer models)."""
    with standin_gateway(tmp_root, "temperature-0.7", f"inference.urls=[{vllm_service}]",
                         "actor_rollout_ref.rollout.temperature=0.7", standins=0) as (url, _, _):
        yield url


def _captured(client, rid: str, cfg) -> tuple[list[CapturedCall], PolicyTrainer, Any]:
    """The rollout's captured calls, a trainer on the base model, and the calls' batch."""
    calls = [CapturedCall.from_json(x) for x in client.lrange(keys.rollout_calls(rid), 0, -1)]
    trainer = PolicyTrainer(cfg, str(MODEL))
    samples = [Sample(c.prompt_ids, c.response_ids, c.logprobs, 0.0, "g", c.temperature, 0)
               for c in calls]
    return calls, trainer, to_batch(samples, trainer.pad_id)


def test_logprobs_agree_at_temperature_0_7(redis_client, gateway_at_0_7, new_rollout, cfg):
    # earlier tests may have trained the engine's weights: serve the base model again
    weights.reload_weights(cfg.inference.urls[0], MODEL)
    rid, token, base = new_rollout(gateway_at_0_7)
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=5)
    for text in ("abc", "dcba", "reverse bad"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                       max_tokens=6, temperature=0.7)
    calls, trainer, batch = _captured(redis_client, rid, cfg)
    assert len(calls) == 3 and all(c.temperature == 0.7 for c in calls)
    with torch.no_grad():
        ours, _ = token_log_probs(trainer.model, batch)
        batch.temperatures.fill_(1.0)
        wrong, _ = token_log_probs(trainer.model, batch)
    mask = batch.response_mask.bool()
    gap = (ours - batch.rollout_log_probs)[mask].abs().mean().item()
    wrong_gap = (wrong - batch.rollout_log_probs)[mask].abs().mean().item()
    assert gap < 1e-3, gap
    assert wrong_gap > 20 * max(gap, 1e-5), (gap, wrong_gap)


def test_constrained_decoding_returns_the_masked_distributions_logprobs(
        redis_client, cfg, new_rollout, gateway_service):
    """Under a grammar (here a regex: only 'a' and 'b', then the end) vLLM masks the logits
    before it samples and computes log-probs, so each token's log-prob is its share of the
    mass the mask kept: at least the unmasked log-prob the trainer computes. The capture
    says which parameter constrained it."""
    weights.reload_weights(cfg.inference.urls[0], MODEL)
    rid, token, base = new_rollout()
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=5)
    # the second as an agent written for an older vLLM asks (guided_regex, which vLLM now
    # ignores): sent on as structured_outputs, so it is held to the grammar all the same
    for text, extra in (("abc", {"structured_outputs": {"regex": "[ab]+"}}),
                        ("reverse bad", {"guided_regex": "[ab]+"})):
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], max_tokens=6,
            extra_body=extra)
        assert re.fullmatch("[ab]*", answer.choices[0].message.content), answer
    calls, trainer, batch = _captured(redis_client, rid, cfg)
    assert len(calls) == 2 and all(c.constrained == "structured_outputs" for c in calls)
    with torch.no_grad():
        unmasked, _ = token_log_probs(trainer.model, batch)
    mask = batch.response_mask.bool()
    lifted = (batch.rollout_log_probs - unmasked)[mask]  # -log(mass kept), per token
    assert (lifted > -1e-3).all(), lifted
    assert lifted.mean().item() > 0.05, lifted  # the mask removed most of the vocabulary

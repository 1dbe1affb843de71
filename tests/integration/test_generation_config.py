"""A model's generation_config.json does not shape the rollouts' sampling: the server is
started so that sampling settings a model ships (top_k, top_p, penalties) never apply to a
call that does not set them, whatever ``gateway.sampling`` does with the call."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
import requests

from tests.conftest import INFERENCE_AUTH, REPO, model_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def greedy_config_server(tmp_path_factory):
    # top_k 1 makes sampling greedy: applied, every processed log-prob would be 0
    model = tmp_path_factory.mktemp("models") / "topk1"
    shutil.copytree(REPO / "var" / "models" / "tiny-qwen2", model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update(top_k=1, top_p=0.5, repetition_penalty=1.3, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(gen))
    with model_server(model, "topk1", tmp_path_factory.mktemp("logs")) as url:
        yield url


def test_the_models_generation_config_does_not_apply(greedy_config_server):
    answer = requests.post(f"{greedy_config_server}/v1/completions", json={
        "model": "topk1", "prompt": "reverse abc", "max_tokens": 24, "temperature": 1.0,
        "logprobs": 0, "ignore_eos": True}, timeout=60, headers=INFERENCE_AUTH).json()
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == 24
    # The random tiny model's next-token distribution is near uniform over 27 tokens
    # (log-prob about -3.3); under top_k 1 every token would have log-prob 0.
    assert statistics.fmean(logprobs) < -1.0, logprobs

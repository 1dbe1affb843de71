"""A call whose prompt plus ``max_tokens`` exceeds ``inference.max_model_len``, through the
real gateway (gunicorn) in front of a stand-in upstream: the gateway answers OpenAI's 400
``context_length_exceeded`` naming both lengths, the upstream never sees the call, nothing
is captured, and the rollout's record counts it. vLLM's own refusal gets the same code."""

from __future__ import annotations

import openai
import pytest
import requests
from transformers import AutoTokenizer

from app.client import ContextLengthExceeded, GatewayClient
from app.config.loader import REPO_ROOT
from app.state import keys
from tests.conftest import standin_gateway

MAX_MODEL_LEN = 40
TINY = REPO_ROOT / "var" / "models" / "tiny-qwen2"


@pytest.fixture(scope="module")
def checking(redis_service, tmp_root):
    with standin_gateway(tmp_root, "context-check",
                         f"inference.max_model_len={MAX_MODEL_LEN}") as (url, _, upstreams):
        yield url, upstreams[0][0]


@pytest.fixture(scope="module")
def unchecked(redis_service, tmp_root):
    with standin_gateway(tmp_root, "context-unchecked", "gateway.context_check=false") as (
            url, _, upstreams):
        yield url, upstreams[0][0]


def _prompt_tokens(messages: list[dict]) -> int:
    tok = AutoTokenizer.from_pretrained(str(TINY))
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))


def test_an_overflowing_call_is_refused_before_the_upstream(checking, new_rollout,
                                                            redis_client):
    url, upstream = checking
    rid, token, base = new_rollout(url)
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    fits = [{"role": "user", "content": "abc"}]
    client.chat.completions.create(model="m", messages=fits, max_tokens=4)
    seen = requests.get(upstream + "/standin/last", timeout=5).json()

    long = [{"role": "user", "content": "abcd" * 10}]
    prompt = _prompt_tokens(long)
    assert prompt + 4 > MAX_MODEL_LEN >= _prompt_tokens(fits) + 4
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    message = err.value.body["message"]  # type: ignore[index]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
    assert f"{prompt} prompt tokens" in message and "4 completion tokens" in message
    assert requests.get(upstream + "/standin/last", timeout=5).json() == seen  # never sent
    assert redis_client.llen(keys.rollout_calls(rid)) == 1  # only the call that fitted
    assert redis_client.hget(keys.rollout(rid), "context_overflow") == "1"
    # max_tokens counts: the short prompt with a long completion overflows too
    with pytest.raises(openai.BadRequestError, match="36 completion tokens"):
        client.chat.completions.create(model="m", messages=fits, max_tokens=36)
    assert redis_client.hget(keys.rollout(rid), "context_overflow") == "2"


def test_the_project_client_raises_its_own_error(checking, new_rollout):
    url, _ = checking
    _, token, base = new_rollout(url)
    client = GatewayClient(base, token, max_wait_s=5)
    with pytest.raises(ContextLengthExceeded) as err:
        client.completions(prompt="abcd" * 20, max_tokens=4)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"


def test_vllms_own_refusal_gets_the_same_code(unchecked, new_rollout, redis_client):
    url, _ = unchecked
    rid, token, base = new_rollout(url)
    resp = requests.post(base + "/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {token}"},
                         json={"messages": [{"role": "user", "content": "a"}],
                               "standin_overflow": True})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and "maximum context length" in err["message"]
    assert redis_client.hget(keys.rollout(rid), "context_overflow") == "1"
    assert redis_client.llen(keys.rollout_calls(rid)) == 0

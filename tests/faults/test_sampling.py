"""Sampling the trainer cannot model, through the real gateway (gunicorn) in front of a
stand-in upstream: ``enforce`` overrides it before the engine sees it, ``reject`` answers an
OpenAI-style 400 naming the parameter. Greedy decoding, nucleus truncation and a logit bias
are the cases."""

from __future__ import annotations

import pytest
import requests

from app.state import keys
from app.state.records import CapturedCall
from tests.conftest import standin_gateway

CASES = [("temperature", 0), ("top_p", 0.9), ("logit_bias", {"5": 10})]


@pytest.fixture(scope="module")
def enforcing(redis_service, tmp_root):
    with standin_gateway(tmp_root, "sampling-enforce") as (url, _, upstreams):
        yield url, upstreams[0][0]


@pytest.fixture(scope="module")
def rejecting(redis_service, tmp_root):
    with standin_gateway(tmp_root, "sampling-reject", "gateway.sampling=reject") as (url, _, _):
        yield url


def call(base: str, token: str, **params):
    return requests.post(base + "/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {token}"},
                         json={"messages": [{"role": "user", "content": "a"}],
                               "max_tokens": 3, **params})


@pytest.mark.parametrize("name,value", CASES)
def test_enforce_sends_what_the_trainer_models(enforcing, new_rollout, redis_client, cfg,
                                               name, value):
    url, upstream = enforcing
    rid, token, base = new_rollout(url)
    resp = call(base, token, **{name: value})
    assert resp.status_code == 200, resp.text
    sent = requests.get(upstream + "/standin/last", timeout=5).json()
    temperature = float(cfg.actor_rollout_ref.rollout.temperature)
    assert sent["temperature"] == temperature and sent["top_p"] == 1.0
    assert sent["top_k"] == 0 and sent["min_p"] == 0.0 and "logit_bias" not in sent
    [raw] = redis_client.lrange(keys.rollout_calls(rid), 0, -1)
    assert CapturedCall.from_json(raw).temperature == temperature


@pytest.mark.parametrize("name,value", CASES)
def test_reject_names_the_parameter(rejecting, new_rollout, redis_client, name, value):
    rid, token, base = new_rollout(rejecting)
    resp = call(base, token, **{name: value})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == name and err["type"] == "invalid_request_error"
    assert "trainer" in err["message"]
    assert redis_client.llen(keys.rollout_calls(rid)) == 0  # nothing captured
    assert call(base, token).status_code == 200  # the lease was given back; plain calls work

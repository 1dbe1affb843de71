"""The gateway under gunicorn in front of the real vLLM CPU server: the official openai
client works unmodified; every call is captured with the token ids and log-probs vLLM
returned and the policy version that served it; pauses give retryable answers that both the
openai client and carryover's retry client ride through; bad input gets the right 4xx."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import openai
import pytest
import requests

from app.client import GatewayClient
from app.state import keys
from app.state.pause import Pause
from app.state.records import CapturedCall


@pytest.fixture
def gw(redis_client, gateway_service):
    redis_client.set(keys.policy_version(), 7)
    yield redis_client
    Pause(redis_client).resume()


def captured(client, rid) -> list[CapturedCall]:
    return [CapturedCall.from_json(x) for x in client.lrange(keys.rollout_calls(rid), 0, -1)]


def test_openai_client_chat_is_captured_exactly(gw, new_rollout):
    rid, token, base = new_rollout()
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    out = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "abc"}], max_tokens=5,
        logprobs=True, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    (call,) = captured(gw, rid)
    assert call.response_ids == choice.model_extra["token_ids"]
    assert call.prompt_ids == out.model_extra["prompt_token_ids"]
    assert call.logprobs == [c.logprob for c in choice.logprobs.content]
    assert call.policy_version == 7 and call.endpoint == "chat.completions"
    assert call.finish_reason == choice.finish_reason and call.nonfinite_logprobs == 0


def test_agent_without_logprobs_gets_plain_openai_answer_but_capture_is_full(gw, new_rollout):
    rid, token, base = new_rollout()
    raw = requests.post(base + "/chat/completions", headers={"Authorization": f"Bearer {token}"},
                        json={"model": "m", "messages": [{"role": "user", "content": "ab"}],
                              "max_tokens": 3}, timeout=30).json()
    assert "prompt_token_ids" not in raw and "token_ids" not in raw["choices"][0]
    assert raw["choices"][0]["logprobs"] is None
    (call,) = captured(gw, rid)
    assert len(call.logprobs) == len(call.response_ids) >= 1


def test_completions_and_streaming(gw, new_rollout):
    rid, token, base = new_rollout()
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    comp = client.completions.create(model="m", prompt="abc", max_tokens=4, logprobs=0,
                                     extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "abc"}], max_tokens=4, stream=True,
        logprobs=True, extra_body={"return_token_ids": True}))
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get(
        "token_ids") or [])]
    streamed_lp = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs
                   for x in c.choices[0].logprobs.content]
    calls = captured(gw, rid)
    assert [c.endpoint for c in calls] == ["completions", "chat.completions"]
    assert calls[0].response_ids == comp.choices[0].model_extra["token_ids"]
    assert calls[0].logprobs == comp.choices[0].logprobs.token_logprobs
    assert len(calls[0].prompt_ids) == 3
    assert calls[1].stream and calls[1].response_ids == streamed_ids
    assert calls[1].logprobs == streamed_lp and len(streamed_ids) >= 1
    assert len(client.models.list().data) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completions_call_of_several_prompts_captures_each_with_its_own(gw, new_rollout,
                                                                          stream):
    """vLLM answers each prompt of a batch in its own choices, and (streamed) sends each
    prompt's ids on that choice's first chunk: every sample is recorded with its own."""
    rid, token, base = new_rollout()
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    answer = client.completions.create(model="m", prompt=["abc", "ba"], max_tokens=3,
                                       stream=stream)
    if stream:
        list(answer)
    calls = captured(gw, rid)
    assert len(calls) == 2
    assert sorted(len(c.prompt_ids) for c in calls) == [2, 3], [c.prompt_ids for c in calls]


def test_paused_requests_ride_through_with_retries(gw, new_rollout):
    adm = Pause(gw)
    assert adm.pause() == 0
    rid, token, base = new_rollout()
    resp = requests.post(base + "/chat/completions", headers={"Authorization": f"Bearer {token}"},
                         json={"model": "m", "messages": [{"role": "user", "content": "a"}]},
                         timeout=10)
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert resp.json()["error"]["code"] == "paused"
    results: dict = {}
    refused = {"openai": 0}

    def count(response: httpx.Response) -> None:
        refused["openai"] += response.status_code == 503

    def via_openai():
        c = openai.OpenAI(base_url=base, api_key=token, max_retries=20,
                          http_client=httpx.Client(event_hooks={"response": [count]}))
        results["openai"] = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}], max_tokens=2)

    ours = GatewayClient(base, token, max_wait_s=60)

    def via_ours():
        results["ours"] = ours.chat(model="m", messages=[{"role": "user", "content": "a"}],
                                    max_tokens=2)

    threads = [threading.Thread(target=via_openai), threading.Thread(target=via_ours)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not (refused["openai"] and ours.retries) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused["openai"] >= 1 and ours.retries >= 1  # both were refused, and retried
    assert not results  # nothing gets through while paused
    adm.resume()
    for t in threads:
        t.join(60)
    assert results["openai"].choices and results["ours"]["choices"]
    assert len(captured(gw, rid)) == 2  # only the two admitted calls were captured


def test_bad_requests_get_the_right_4xx(gw, new_rollout, cfg):
    rid, token, base = new_rollout()
    auth = {"Authorization": f"Bearer {token}"}
    url = base + "/chat/completions"

    def post(**kw):
        return requests.post(url, timeout=10, **kw)

    cases = [
        (post(headers=auth, data="{not json", ), 400, "invalid_request"),
        (post(headers=auth, json=["a list"]), 400, "invalid_request"),
        (post(headers=auth, json={"messages": "hi"}), 400, "invalid_request"),
        (post(headers=auth, json={"messages": [{"role": "user", "content": "a"}],
                                  "max_tokens": "many"}), 400, "invalid_request"),
        (post(headers=auth, json={"messages": [{"role": "user", "content": "a"}],
                                  "stream": "yes"}), 400, "invalid_request"),
        (post(json={"messages": []}), 401, "invalid_api_key"),
        (post(headers={"Authorization": "Bearer wrong"}, json={}), 401, "invalid_api_key"),
        (requests.post(base.replace(rid, "no-such-rollout") + "/chat/completions",
                       headers=auth, json={}, timeout=10), 404, "rollout_not_found"),
        (post(headers=auth, data="x" * (cfg.gateway.max_body_bytes + 10)), 413, None),
        (requests.post(cfg.gateway.url + "/admin/pause", headers=auth, timeout=10), 401,
         "invalid_admin_token"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, (resp.status_code, resp.text[:200])
        body = resp.json()["error"]
        assert body["message"]
        if code:
            assert body["code"] == code
    assert not Pause(gw).is_paused()
    # and it keeps serving
    ok = post(headers=auth, json={"messages": [{"role": "user", "content": "a"}],
                                  "max_tokens": 1})
    assert ok.status_code == 200


def test_closed_rollout_is_refused(gw, new_rollout):
    rid, token, base = new_rollout()
    gw.hset(keys.rollout(rid), "status", "finished")
    resp = requests.post(base + "/chat/completions", headers={"Authorization": f"Bearer {token}"},
                         json={"messages": [{"role": "user", "content": "a"}]}, timeout=10)
    assert resp.status_code == 409
    assert resp.headers["x-should-retry"] == "false"


def test_the_openai_client_does_not_retry_a_closed_rollout(gw, new_rollout, caplog):
    """The SDK retries a 409 by its status rules; the gateway's x-should-retry: false stops
    it (a closed rollout never reopens)."""
    rid, token, base = new_rollout()
    gw.hset(keys.rollout(rid), "status", "finished")
    client = openai.OpenAI(base_url=base, api_key=token, max_retries=3)
    caplog.set_level(logging.INFO, logger="openai")
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    assert not [r for r in caplog.records if "Retrying request" in r.getMessage()]


def test_admin_endpoints_need_the_admin_token(gw, cfg):
    admin = {"Authorization": "Bearer test-admin-token"}
    r = requests.post(cfg.gateway.url + "/admin/pause", headers=admin, timeout=10)
    assert r.status_code == 200 and r.json()["paused"] is True
    assert requests.get(cfg.gateway.url + "/admin/state", headers=admin,
                        timeout=10).json()["paused"] is True
    d = requests.post(cfg.gateway.url + "/admin/drain", headers=admin, json={"timeout_s": 1},
                      timeout=10).json()
    assert d["cancelled"] == 0
    r = requests.post(cfg.gateway.url + "/admin/resume", headers=admin, timeout=10)
    assert r.json()["paused"] is False


def test_agents_can_post_their_reward(gw, new_rollout, cfg):
    rid, token, base = new_rollout()
    url = base.rsplit("/v1", 1)[0] + "/reward"
    auth = {"Authorization": f"Bearer {token}"}
    assert requests.post(url, json={"reward": 0.75}, headers=auth, timeout=10).status_code == 200
    assert gw.hget(keys.rollout(rid), "reward") == "0.75"
    assert requests.post(url, json={"reward": "high"}, headers=auth, timeout=10).status_code == 400
    # past what a float32 group spread can square
    r = requests.post(url, json={"reward": 1e30}, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reward", r.text
    assert gw.hget(keys.rollout(rid), "reward") == "0.75"
    assert requests.post(url, json={"reward": 1}, timeout=10).status_code == 401

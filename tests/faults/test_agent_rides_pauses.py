"""The shipped agent and retry client take their retry budget from the run's config and ride
through a pause longer than a handful of retries would."""

from __future__ import annotations

import threading
import time

import pytest

from app.client import GatewayClient, openai_max_retries
from app.state.pause import Pause
from examples.reverse.agent import run as demo_agent
from tests.conftest import standin_gateway
from workers.rollout.controller import LLMEndpoint

PAUSE_S = 12.0


@pytest.fixture(scope="module")
def gateway(redis_service, tmp_root):
    with standin_gateway(tmp_root, "agent-pauses") as (url, _, _):
        yield url


def paused_for(redis_client, seconds: float) -> threading.Thread:
    adm = Pause(redis_client)
    adm.pause(pause_ttl_s=seconds + 30)
    t = threading.Timer(seconds, adm.resume)
    t.start()
    return t


def test_the_demo_agent_rides_through_a_long_pause(gateway, new_rollout, redis_client):
    rid, token, base = new_rollout(gateway)
    llm = LLMEndpoint(base_url=base, api_key=token, model="tiny-qwen2", rollout_id=rid,
                      max_wait_s=900.0)
    timer = paused_for(redis_client, PAUSE_S)
    started = time.monotonic()
    reward = demo_agent({"text": "abc", "target": "cba"}, llm, tool_median_s=0.0)
    timer.join()
    assert time.monotonic() - started >= PAUSE_S - 1  # it waited the pause out ...
    assert 0.0 <= reward <= 1.0  # ... and finished its two turns


def test_the_budget_comes_from_the_config(monkeypatch):
    assert openai_max_retries(900.0) * 0.2 >= 900.0  # retries cover the budget
    assert LLMEndpoint("u", "k", "m", "r", max_wait_s=42.0).env()["CARRYOVER_MAX_WAIT_S"] == "42.0"
    monkeypatch.setenv("CARRYOVER_MAX_WAIT_S", "1.5")
    assert GatewayClient("http://x", "k").max_wait_s == 1.5

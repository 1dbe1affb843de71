"""Sleep and wake around a collocated update are checked: an engine that does not go to sleep
fails the step before the update starts, with the gateway resumed and nothing changed."""

from __future__ import annotations

import json
import os

import pytest
import requests
from omegaconf import OmegaConf

from app.config import load_config
from app.state import keys
from app.state.pause import Pause
from app.state.records import CapturedCall, GroupRecord, SiblingResult
from tests.conftest import standin_gateway
from workers.trainer import service, weights


@pytest.fixture(scope="module")
def upstream(redis_service, tmp_root):
    with standin_gateway(tmp_root, "sleep-tests") as (_, _, upstreams):
        yield upstreams[0][0]


def behave(url: str, mode: str) -> None:
    requests.post(url + "/standin/sleep", json={"mode": mode}, timeout=5).raise_for_status()


def test_sleep_and_wake_are_checked(upstream):
    behave(upstream, "ok")
    weights.sleep_engines([upstream], 1)
    assert requests.get(upstream + "/is_sleeping", timeout=5).json()["is_sleeping"] is True
    weights.wake_engines([upstream])
    for mode, why in (("ignored", "/is_sleeping says False"), ("refused", "answered 404")):
        behave(upstream, mode)
        with pytest.raises(weights.EngineSleepError, match=why):
            weights.sleep_engines([upstream], 1)
    behave(upstream, "ok")


def test_an_engine_that_did_not_sleep_fails_the_step_before_the_update(
        upstream, redis_client, tmp_path):
    behave(upstream, "ignored")
    cfg = load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                             f"inference.urls=[{upstream}]", "inference.device=cuda",
                             "trainer.device=cpu", "trainer.pause_during_update=true",
                             f"trainer.weights_dir={tmp_path / 'w'}",
                             f"trainer.checkpoint_dir={tmp_path / 'c'}",
                             "actor_rollout_ref.rollout.n=2"])
    run_id = "sleepless"
    redis_client.hset(keys.run(run_id), mapping={
        "run_id": run_id, "config": json.dumps(OmegaConf.to_container(cfg))})
    gid = f"{run_id}-g0"
    redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run_id, 0, n=2).to_hash())
    for i, reward in enumerate((1.0, 0.0)):
        rid = f"{gid}.{i}.x"
        redis_client.hset(keys.group_results(gid), str(i),
                          SiblingResult(i, rid, "ok", reward, 1, 0.1).to_json())
        redis_client.rpush(keys.rollout_calls(rid), CapturedCall(
            [1, 3, 4], [5, 6, 2], [-3.0, -3.1, -3.2], "stop", 0, 1.0, "u", 0, 0,
            "chat.completions").to_json())
    redis_client.rpush(keys.run_step_groups(run_id, 0), gid)
    redis_client.set(keys.policy_version(), 7)
    service._resident = service.Resident(run_id, _untouchable(), weights.PROBE_IDS,
                                         published=True)
    with pytest.raises(service.StepError, match="did not go to sleep"):
        service.train_step(redis_client, run_id, 0)
    assert not Pause(redis_client).is_paused()  # resumed
    assert redis_client.get(keys.policy_version()) == "7"
    assert redis_client.get(keys.run_step_result(run_id, 0)) is None
    service._resident = None
    behave(upstream, "ok")


def _untouchable():
    """A trainer whose update must not run."""

    class Trainer:
        device = "cpu"
        pad_id = 0

        def update(self, *a, **k):
            raise AssertionError("the update ran although the engine did not sleep")

    return Trainer()

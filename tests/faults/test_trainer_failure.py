"""A failure after the gateway was paused (here: the inference server is unreachable when
the new weights are loaded) leaves the gateway resumed, the policy version unchanged and the
step untrained, so the step can be retried."""

from __future__ import annotations

import json
import os

import pytest

from app.config import load_config
from app.state import keys
from app.state.pause import Pause
from app.state.records import CapturedCall, GroupRecord, SiblingResult
from tests.conftest import free_port
from workers.trainer.step import train_step


def test_gateway_resumed_after_failure_mid_update(redis_client, tmp_path):
    dead = free_port()
    cfg = load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                             f"inference.urls=[http://127.0.0.1:{dead}]",
                             f"trainer.weights_dir={tmp_path / 'w'}",
                             f"trainer.checkpoint_dir={tmp_path / 'c'}",
                             "trainer.reload_timeout_s=2", "inference.startup_timeout_s=2",
                             "trainer.upstream_check_s=0.5",
                             "actor_rollout_ref.rollout.n=2"])

    run_id = "fail-run"
    redis_client.hset(keys.run(run_id), mapping={
        "run_id": run_id, "config": json.dumps(cfg.to_dict())})
    gid = "fail-run-g0"
    redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run_id, 0, n=2).to_hash())
    for i, reward in enumerate((1.0, 0.0)):
        rid = f"{gid}.{i}.x"
        redis_client.hset(keys.group_results(gid), str(i), SiblingResult(
            i, rid, "ok", reward, 1, 0.1).to_json())
        redis_client.rpush(keys.rollout_calls(rid), CapturedCall(
            [1, 3, 4], [5, 6, 2], [-3.0, -3.1, -3.2], "stop", 0, 1.0, "u", 0, 0,
            "chat.completions").to_json())
    redis_client.rpush(keys.run_step_groups(run_id, 0), gid)
    redis_client.set(keys.policy_version(), 5)
    with pytest.raises(Exception, match="Connection|connect|refused"):  # noqa: B017
        train_step(redis_client, run_id, 0)
    assert not Pause(redis_client).is_paused()
    assert redis_client.get(keys.policy_version()) == "5"
    assert redis_client.get(keys.run_step_result(run_id, 0)) is None

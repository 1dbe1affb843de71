"""The collocated cycle against a stand-in engine that sleeps, pauses and loads as vLLM does:
sleep and wake are checked (an engine that does not go to sleep fails the step before the
update, with the gateway resumed and nothing changed), the memory goes back in verl's order,
a load that outlasts its timeout is not resumed, an engine a killed trainer left asleep is
woken and not routed to meanwhile, and a server that restarted unseen is reloaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests

from app.config import load_config
from app.state import keys
from app.state.pause import Pause
from app.state.records import CapturedCall, GroupRecord, SiblingResult
from gateway.upstream import Upstreams
from tests.conftest import free_port, standin_gateway
from tests.faults.test_worker_kills import wait_for
from workers.trainer import resident, weights
from workers.trainer.errors import StepError
from workers.trainer.keeper import UpstreamKeeper
from workers.trainer.settings import TrainerSettings
from workers.trainer.step import train_step


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


def test_a_server_that_died_asleep_is_left_out_of_the_wake(upstream):
    """A server that went to sleep and then died (its process is gone: connection refused)
    is left out when the weights wake; the others wake, and the load that follows marks
    it stale (it comes back fresh)."""
    behave(upstream, "ok")
    dead = f"http://127.0.0.1:{free_port()}"
    requests.post(upstream + "/standin/sleep", json={"clear_events": True}, timeout=5)
    held = weights.sleep_engines([upstream], 1)
    held.urls.insert(0, dead)  # it slept, then died
    try:
        held.wake(["weights"])
        assert held.urls == [upstream]
        assert events(upstream) == ["sleep", "wake_up:weights"]
        held.release(tags=["kv_cache"])
        assert requests.get(upstream + "/is_sleeping", timeout=5).json()["is_sleeping"] is False
    finally:
        held.release(check=False)


def _collocated_cfg(upstream: str, tmp_path, *overrides: str):
    # a CPU trainer driving a "GPU" server that sleeps around the update
    return load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                              f"inference.urls=[{upstream}]", "inference.device=cuda",
                              "trainer.device=cpu", "trainer.pause_during_update=true",
                              f"trainer.weights_dir={tmp_path / 'w'}",
                              f"trainer.checkpoint_dir={tmp_path / 'c'}",
                              "actor_rollout_ref.rollout.n=2", *overrides])


def _prepared_run(redis_client, run_id: str, cfg, step: int = 0) -> None:
    """A run whose step ``step`` has one complete group of two rollouts to train."""
    redis_client.hset(keys.run(run_id), mapping={
        "run_id": run_id, "config": json.dumps(cfg.to_dict())})
    gid = f"{run_id}-g{step}"
    redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run_id, step, n=2).to_hash())
    for i, reward in enumerate((1.0, 0.0)):
        rid = f"{gid}.{i}.x"
        redis_client.hset(keys.group_results(gid), str(i),
                          SiblingResult(i, rid, "ok", reward, 1, 0.1).to_json())
        redis_client.rpush(keys.rollout_calls(rid), CapturedCall(
            [1, 3, 4], [5, 6, 2], [-3.0, -3.1, -3.2], "stop", 0, 1.0, "u", 0, 0,
            "chat.completions").to_json())
    redis_client.rpush(keys.run_step_groups(run_id, step), gid)


def events(url: str) -> list[str]:
    return requests.get(url + "/standin/events", timeout=5).json()


def test_an_engine_that_did_not_sleep_fails_the_step_before_the_update(
        upstream, redis_client, tmp_path):
    behave(upstream, "ignored")
    run_id = "sleepless"
    _prepared_run(redis_client, run_id, _collocated_cfg(upstream, tmp_path))
    redis_client.set(keys.policy_version(), 7)
    resident._resident = resident.Resident(run_id, _untouchable(), weights.PROBE_IDS,
                                           published=True)
    try:
        with pytest.raises(StepError, match="did not go to sleep"):
            train_step(redis_client, run_id, 0)
        assert not Pause(redis_client).is_paused()  # resumed
        assert redis_client.get(keys.policy_version()) == "7"
        assert redis_client.get(keys.run_step_result(run_id, 0)) is None
    finally:  # the module's later tests start from a well-behaved stand-in, no trainer
        resident._resident = None
        behave(upstream, "ok")


def test_the_memory_goes_back_in_verls_order(upstream, redis_client, tmp_path, real_trainer,
                                             monkeypatch, caplog):
    """A collocated step through verl's engine: the engine sleeps, the update, the export,
    then the weights wake alone, the load, the trainer gives its memory back on every rank,
    and only then the KV cache wakes; each rank's memory is recorded at each point. The KV
    cache wakes once the new version is set (vLLM resumes the engine as it wakes whole: it
    woke first, and calls sampled on the new weights under the old version's label)."""
    release = weights.Held.release
    at_kv_wake: list[str | None] = []

    def release_noting_the_version(self, *args, **kwargs):
        if kwargs.get("tags") == ["kv_cache"]:
            at_kv_wake.append(redis_client.get(keys.policy_version()))
        return release(self, *args, **kwargs)

    monkeypatch.setattr(weights.Held, "release", release_noting_the_version)
    requests.post(upstream + "/standin/sleep", json={"mode": "ok", "asleep": False,
                                                     "clear_events": True}, timeout=5)
    run_id = "wake-order"
    # the stand-in scores every probe token -1: a tolerance that admits it
    cfg = _collocated_cfg(upstream, tmp_path, "trainer.probe_tolerance=100")
    _prepared_run(redis_client, run_id, cfg)
    # the servers already hold this trainer's weights (no first load of them)
    resident.resident_trainer(run_id, cfg, TrainerSettings.from_config(cfg)).published = True
    m = train_step(redis_client, run_id, 0)
    assert events(upstream) == ["sleep", "wake_up:weights", "collective_rpc:reload_weights",
                                "reset_prefix_cache", "wake_up:kv_cache"]
    assert requests.get(upstream + "/is_sleeping", timeout=5).json()["is_sleeping"] is False
    stages = [k for k in m if k.startswith("memory/trainer_rank0_")
              and k.endswith("_allocated_gb")]
    assert stages == [f"memory/trainer_rank0_{s}_allocated_gb" for s in (
        "after_update", "before_weights_wake", "before_kv_cache_wake")]
    # the tiny model's fp32 weights, gradients and Adam state: held through the step
    assert all(m[k] > 0 for k in stages)
    # the server keeps the version it loaded (the upstream keeper reads it back)
    assert requests.get(upstream + "/weight_info", timeout=5).json()["weight_version"] == \
        str(m["policy/version"])
    assert at_kv_wake == [str(m["policy/version"])]
    # asleep until the KV cache woke, it reported paused: not an engine a dead trainer left
    assert "left paused by a dead trainer" not in caplog.text


@pytest.mark.parametrize("placement", ["keep", "collocated"])
def test_a_load_slower_than_its_timeout_is_not_resumed(upstream, redis_client, tmp_path,
                                                       real_trainer, placement):
    """``trainer.reload_timeout_s`` bounds each load; an engine whose load did not report
    success stays paused (``keep``) or is woken but not trusted (collocated, asleep through
    the update), and is stale either way (the keeper restores it); the step fails."""
    requests.post(upstream + "/standin/sleep", json={"mode": "ok", "asleep": False,
                                                     "clear_events": True}, timeout=5)
    run_id = f"slow-load-{placement}"
    mode = ["trainer.pause_during_update=false", "gateway.drain_mode=keep"] \
        if placement == "keep" else []
    cfg = _collocated_cfg(upstream, tmp_path, "trainer.probe_tolerance=100", *mode,
                          "trainer.reload_timeout_s=1.5", "inference.startup_timeout_s=1")
    _prepared_run(redis_client, run_id, cfg)
    resident.resident_trainer(run_id, cfg, TrainerSettings.from_config(cfg)).published = True
    requests.post(upstream + "/standin/reload", json={"delay_s": 3}, timeout=5)
    try:
        with pytest.raises(weights.WeightSyncError, match="did not answer within 2 s"):
            train_step(redis_client, run_id, 0)
        paused = requests.get(upstream + "/is_paused", timeout=5).json()["is_paused"]
        assert paused is (placement == "keep")
        assert "resume" not in events(upstream)
        # never left asleep, even when its load failed
        assert requests.get(upstream + "/is_sleeping", timeout=5).json()["is_sleeping"] is False
        assert redis_client.sismember(keys.upstreams_stale(), upstream)
        assert not Pause(redis_client).is_paused()  # the gateway is resumed all the same
        assert redis_client.get(keys.policy_version()) in (None, "0")  # not bumped
    finally:
        requests.post(upstream + "/standin/reload", json={"delay_s": 0}, timeout=5)
        weights.resume_engines([upstream])
        redis_client.srem(keys.upstreams_stale(), upstream)


def _untouchable():
    """A trainer whose update must not run."""

    class Trainer:
        device = "cpu"
        pad_id = 0

        def update(self, *a, **k):
            raise AssertionError("the update ran although the engine did not sleep")

    return Trainer()


_KILLED_TRAINER = """
import sys, redis
from app.state.pause import Pause
from workers.trainer import weights
client = redis.Redis.from_url(sys.argv[1], decode_responses=True)
Pause(client).pause(pause_ttl_s=float(sys.argv[3]))  # a lease the trainer would extend
if sys.argv[4] == "sleep":
    weights.sleep_engines([sys.argv[2]], 1)
else:
    weights.pause_engines([sys.argv[2]], "keep")
print("held", flush=True)
import time; time.sleep(600)
"""


def _kill_a_trainer_holding(redis_client, upstream: str, what: str, lease_s: float) -> None:
    """A trainer that held the gateway's pause and put the engine to ``what`` (sleep,
    pause), SIGKILLed there."""
    kw = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, redis_url, upstream,
                             str(lease_s), what], stdout=subprocess.PIPE, env=os.environ)
    try:
        assert proc.stdout.readline().strip() == b"held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def _orphaned_once_the_lease_ends(redis_client, upstream: str, gateway, keeper, settings,
                                  held, lease_s: float) -> None:
    """While the dead trainer's pause lives, the engine's state (``held()``: asleep,
    paused) is that update's own and left alone; once the lease has run out the gateway
    routes no call to the engine, and the next trainer task finds it."""
    assert Pause(redis_client).is_paused()
    assert keeper.tick() == [] and resident.take_back_orphans(redis_client, settings) == []
    gateway.check_health(timeout_s=2)
    assert held() and gateway.pick("r") == upstream
    wait_for(lambda: not Pause(redis_client).is_paused(), 3 * lease_s,
             "the dead trainer's pause to end")
    gateway.check_health(timeout_s=2)
    assert gateway.pick("r") is None   # held with no pause: a call would hang or crash it
    assert resident.take_back_orphans(redis_client, settings) == [upstream]   # the next task


def test_an_engine_left_asleep_by_a_killed_trainer_is_woken(upstream, redis_client, tmp_path):
    """A trainer SIGKILLed between sleep and wake skips its ``finally``: the engine stays
    asleep behind a healthy /health. Once its pause lease runs out the gateway does not
    route to it, and the next trainer task (or the keeper's tick) wakes it and has the
    current weights loaded (asleep, a level-2 engine dropped them)."""
    behave(upstream, "ok")
    gateway = Upstreams([upstream], client=redis_client, sleep_check=True, stale_refresh_s=0)
    keeper = UpstreamKeeper(redis_client, [upstream], "m", 0.1, sleep_check=True)
    settings = TrainerSettings.from_config(_collocated_cfg(upstream, tmp_path))
    lease_s = 10.0  # long enough for the checks below on a slow machine
    _kill_a_trainer_holding(redis_client, upstream, "sleep", lease_s)

    def asleep() -> bool:
        return requests.get(upstream + "/is_sleeping", timeout=5).json()["is_sleeping"]

    try:
        _orphaned_once_the_lease_ends(redis_client, upstream, gateway, keeper, settings,
                                      asleep, lease_s)
        assert not asleep()
        # woken, it is stale until the keeper has loaded the current weights (none are
        # published here: it is only taken back)
        assert redis_client.sismember(keys.upstreams_stale(), upstream)
        assert keeper.tick() == [upstream]
        gateway.check_health(timeout_s=2)
        assert gateway.pick("r") == upstream
        # the keeper's tick finds one left asleep between tasks too
        requests.post(upstream + "/standin/sleep", json={"asleep": True}, timeout=5)
        assert keeper.tick() == [upstream]
        assert not asleep() and not redis_client.sismember(keys.upstreams_stale(), upstream)
    finally:
        redis_client.srem(keys.upstreams_stale(), upstream)
        requests.post(upstream + "/standin/sleep", json={"asleep": False}, timeout=5)


def _published(redis_client, tmp_path, version: int) -> None:
    """``version`` recorded as published (verified) and current, as a step leaves it."""
    ids = weights.PROBE_IDS
    (tmp_path / f"v{version}").mkdir(exist_ok=True)
    redis_client.hset(keys.policy_published(), mapping={
        "version": version, "path": str(tmp_path / f"v{version}"), "model": "m",
        # the stand-in scores every probe token -1
        "probe": json.dumps([-1.0] * (len(ids) - 1)), "probe_ids": json.dumps(ids)})
    redis_client.set(keys.policy_version(), version)


def test_an_engine_left_paused_by_a_killed_trainer_is_resumed(upstream, redis_client,
                                                              tmp_path):
    """Without sleep (``drain_mode: keep``), a trainer SIGKILLed between the engines'
    /pause and their /resume leaves them paused: vLLM schedules no new request, so every
    agent's call would hang there. Once the dead trainer's pause lease runs out, the
    gateway does not route to it, the next trainer task marks it stale, and the keeper
    loads the published weights into it (the dead trainer may have been mid-load), then
    resumes it. If the dead trainer had bumped the version past the published one, the
    server waits, stale, for the next step's load instead."""
    behave(upstream, "ok")
    gateway = Upstreams([upstream], client=redis_client, stale_refresh_s=0)
    keeper = UpstreamKeeper(redis_client, [upstream], "m", 0.1)
    settings = TrainerSettings.from_config(load_config(None, [
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]), f"inference.urls=[{upstream}]",
        "gateway.drain_mode=keep"]))
    lease_s = 10.0
    _published(redis_client, tmp_path, 3)
    requests.post(upstream + "/update_weight_version", json={"new_version": "3"}, timeout=5)

    def engine_paused() -> bool:
        return requests.get(upstream + "/is_paused", timeout=5).json()["is_paused"]

    _kill_a_trainer_holding(redis_client, upstream, "pause", lease_s)
    try:
        _orphaned_once_the_lease_ends(redis_client, upstream, gateway, keeper, settings,
                                      engine_paused, lease_s)
        assert redis_client.sismember(keys.upstreams_stale(), upstream)
        assert engine_paused()   # not resumed on weights a dead load may have half written
        requests.post(upstream + "/standin/sleep", json={"clear_events": True}, timeout=5)
        assert keeper.tick() == [upstream]
        assert events(upstream) == ["collective_rpc:reload_weights", "reset_prefix_cache",
                                    "resume"]   # loaded, then resumed
        assert not engine_paused()
        assert not redis_client.sismember(keys.upstreams_stale(), upstream)
        gateway.check_health(timeout_s=2)
        assert gateway.pick("r") == upstream
        # left paused by a trainer that died after bumping the version to 4, unverified:
        # loading version 3 would serve it labelled 4, so the server waits for the next load
        requests.post(upstream + "/pause", params={"mode": "keep"}, timeout=5)
        redis_client.set(keys.policy_version(), 4)
        assert keeper.tick() == [] and engine_paused()
        assert redis_client.sismember(keys.upstreams_stale(), upstream)
        _published(redis_client, tmp_path, 4)   # the next step verified version 4
        assert keeper.tick() == [upstream] and not engine_paused()
        # what was last published is another model's (another config's run): nothing of
        # this model's to load, and the engine is still taken back
        redis_client.hset(keys.policy_published(), "model", "other")
        requests.post(upstream + "/pause", params={"mode": "keep"}, timeout=5)
        assert keeper.tick() == [upstream] and not engine_paused()
        assert not redis_client.sismember(keys.upstreams_stale(), upstream)
    finally:
        redis_client.srem(keys.upstreams_stale(), upstream)
        redis_client.delete(keys.policy_published(), keys.policy_version())
        requests.post(upstream + "/resume", timeout=5)


def test_the_keeper_reloads_a_server_that_restarted_unseen(upstream, redis_client, tmp_path):
    """Behind a load balancer a restarted server never looks down: it answers /health and
    serves its initial weights. It says so in /weight_info ("default", not the version it
    was given), and the keeper reloads it."""
    requests.post(upstream + "/standin/sleep", json={"clear_events": True}, timeout=5)
    _published(redis_client, tmp_path, 3)
    keeper = UpstreamKeeper(redis_client, [upstream], "m", 0.01)
    try:
        requests.post(upstream + "/update_weight_version", json={"new_version": "3"}, timeout=5)
        assert keeper.tick() == []   # it holds the published version
        requests.post(upstream + "/update_weight_version", json={"new_version": "default"},
                      timeout=5)   # what a restart leaves
        assert keeper.tick() == [upstream]
        assert events(upstream) == ["collective_rpc:reload_weights", "reset_prefix_cache"]
        assert weights.loaded_version(upstream) == "3"
        assert not redis_client.sismember(keys.upstreams_stale(), upstream)
    finally:
        redis_client.delete(keys.policy_published(), keys.policy_version())

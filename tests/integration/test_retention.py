"""A trained group's captured data is released once its step is stored: calls, rollout
records and Celery's copies of its results go at once, its record and results expire later."""

from __future__ import annotations

import json

from app.state import keys, retention


def test_release_trained(redis_client):
    r = redis_client
    gid = "ret-g0"
    rids = [f"{gid}.0.a", f"{gid}.0.b", f"{gid}.1.c"]  # sibling 0 took two attempts
    for rid in rids:
        r.hset(keys.rollout(rid), "status", "done")
        r.rpush(keys.rollout_calls(rid), "{}")
        r.rpush(keys.group_rollouts(gid), rid)
    r.hset(keys.group(gid), mapping={"task_ids": json.dumps(["t0", "t1"]),
                                     "callback_id": "cb"})
    r.hset(keys.group_results(gid), "0", "{}")
    for task in ("t0", "t1", "cb"):
        r.set(retention.celery_result_key(task), "{}")
    r.set(keys.group_done(gid), "1")
    deleted = retention.release_trained(r, [gid], keep_s=120)
    assert deleted == 2 * len(rids) + 1 + 3
    assert not any(r.exists(keys.rollout(x), keys.rollout_calls(x)) for x in rids)
    assert not r.exists(*(retention.celery_result_key(t) for t in ("t0", "t1", "cb")))
    assert 0 < r.ttl(keys.group(gid)) <= 120 and 0 < r.ttl(keys.group_results(gid)) <= 120
    assert r.ttl(keys.group_done(gid)) == -1  # the exactly-once guard keeps its own TTL


def test_a_groups_training_claim_lives_a_week(redis_client):
    """A group is claimed for one step (``group_trained``): a retry of that step claims it
    again, another step does not, and the claim expires with the run's other guards
    instead of staying for ever."""
    from workers.trainer.once import claim_groups

    r = redis_client
    gid = "claim-g0"
    assert claim_groups(r, [gid], 3) == [gid]
    assert claim_groups(r, [gid], 3) == [gid]   # the step's retry
    assert claim_groups(r, [gid], 4) == []      # never trained twice
    assert retention.GUARD_TTL_S - 60 < r.ttl(keys.group_trained(gid)) <= retention.GUARD_TTL_S


def test_a_call_that_ends_after_its_group_was_released_still_expires(redis_client):
    """A group cancelled (or dropped) while a sibling's first call is still generating: its
    keys are given their TTL before the calls list exists, and the call recorded after made
    one that lived for ever."""
    from app.state.pause import Admission

    r = redis_client
    gid, rid = "ret-late-g", "ret-late-g.0.a"
    r.hset(keys.rollout(rid), "status", "running")
    r.rpush(keys.group_rollouts(gid), rid)
    gateway = Admission(r)
    status, lease, _ = gateway.admit(rid)
    assert status == 1
    retention.expire_untrained(r, gid)  # the cancel, while the call is in flight
    assert not r.exists(keys.rollout_calls(rid))
    assert gateway.record_and_release(lease, ["{}"])
    assert 0 < r.ttl(keys.rollout_calls(rid)) <= retention.GUARD_TTL_S


def test_a_step_stored_by_a_trainer_killed_before_releasing_is_released_when_sent_again(
        redis_client, tmp_path):
    """The trainer stored the step's result and died before releasing what its groups
    captured: the step sent again answers from the stored result and releases them."""

    from app.config import load_config
    from app.driver.collector import Collector
    from workers.trainer.step import train_step

    r = redis_client
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    cfg = load_config(None, [f"data.train_files={data}", "trainer.trained_data_ttl_s=120"])
    run = "ret-killed-trainer"
    Collector.create_run(r, run, cfg.to_dict(), "async")
    gid, rid = f"{run}-g0", f"{run}-g0.0.a"
    r.rpush(keys.group_rollouts(gid), rid)
    r.rpush(keys.rollout_calls(rid), "{}")
    r.hset(keys.group(gid), "status", "selected")
    r.rpush(keys.run_step_groups(run, 0), gid)
    r.set(keys.run_step_result(run, 0), json.dumps({"actor/pg_loss": 0.5}))  # then killed
    assert train_step(r, run, 0) == {"actor/pg_loss": 0.5}
    assert not r.exists(keys.rollout_calls(rid))
    assert 0 < r.ttl(keys.group(gid)) <= 120

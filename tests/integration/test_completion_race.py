"""Completion and the age cap's cancel exclude each other, whatever the interleaving: a group
cancelled while its chord callback runs is never marked complete (it would be trained although
its prompt was re-queued), and one completed before the cancel leaves the ready set."""

from __future__ import annotations

import json

import pytest

from app.config import load_config
from app.driver.collector import Collector
from app.state import completion, keys
from app.state.records import GroupRecord, SiblingResult


def setup_group(redis_client, tmp_path, run: str) -> tuple[Collector, str]:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "s0"}) + "\n")
    cfg = load_config(None, [f"data.train_files={data}", "actor_rollout_ref.rollout.n=2",
                             "agentlightning.async_rollout.max_carry_over_age_steps=1"])
    Collector.create_run(redis_client, run, cfg.to_dict(), "async")
    gid = f"{run}-g0"
    redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run, 0, n=2).to_hash())
    redis_client.zadd(keys.run_active(run), {gid: 0})
    for i in range(2):
        redis_client.hset(keys.group_results(gid), str(i),
                          SiblingResult(i, f"{gid}.{i}.x", "ok", 0.5, 1, 0.1).to_json())
    return Collector(redis_client, run, cfg), gid


def test_cancel_inside_the_completion_window(redis_client, tmp_path, monkeypatch):
    collector, gid = setup_group(redis_client, tmp_path, "race")
    read = completion.read_group

    def read_then_cancel(client, group_id):
        rec = read(client, group_id)  # the callback has read the group (status active) ...
        assert collector.cancel_stale(step=5) == 1  # ... when the age cap cancels it
        return rec

    monkeypatch.setattr(completion, "read_group", read_then_cancel)
    assert completion.finish_group(redis_client, gid) == "cancelled"
    assert redis_client.hget(keys.group(gid), "status") == "cancelled"
    assert redis_client.zscore(keys.run_ready("race"), gid) is None  # never trainable
    assert redis_client.lrange(keys.run_requeue("race"), 0, -1) == ["0"]  # re-queued once


def test_cancel_after_completion_removes_it_from_the_ready_set(redis_client, tmp_path):
    collector, gid = setup_group(redis_client, tmp_path, "race2")
    assert completion.finish_group(redis_client, gid) == "complete"
    assert redis_client.zscore(keys.run_ready("race2"), gid) == 0
    assert collector.cancel_stale(step=5) == 1
    assert redis_client.zscore(keys.run_ready("race2"), gid) is None
    assert completion.finish_group(redis_client, gid) == "cancelled"  # a late duplicate


def test_an_early_callback_never_recreates_an_expired_record(redis_client, tmp_path,
                                                             monkeypatch):
    # a partial group whose record expires (it was dropped or cancelled long ago) between
    # the callback's read and its early flag: the flag must not bring back a one-field
    # record that no TTL would ever remove
    _, gid = setup_group(redis_client, tmp_path, "expired")
    redis_client.hdel(keys.group_results(gid), "1")
    results = completion.sibling_results

    def results_then_expire(client, group_id):
        found = results(client, group_id)
        client.delete(keys.group(group_id))  # the record's TTL runs out here
        return found

    monkeypatch.setattr(completion, "sibling_results", results_then_expire)
    assert completion.finish_group(redis_client, gid) == "gone"
    assert not redis_client.exists(keys.group(gid))


def test_a_callback_never_recreates_a_record_that_expired_while_it_ran(redis_client, tmp_path,
                                                                      monkeypatch):
    _, gid = setup_group(redis_client, tmp_path, "expired2")
    results = completion.sibling_results

    def results_then_expire(client, group_id):
        found = results(client, group_id)
        client.delete(keys.group(group_id))
        return found

    monkeypatch.setattr(completion, "sibling_results", results_then_expire)
    assert completion.finish_group(redis_client, gid) == "gone"
    assert not redis_client.exists(keys.group(gid))
    assert redis_client.zscore(keys.run_ready("expired2"), gid) is None  # never trainable


def test_a_callback_whose_run_record_expired_finds_nothing_to_do(redis_client, tmp_path):
    # an evaluation run's record is kept for less time than its dropped groups' records
    _, gid = setup_group(redis_client, tmp_path, "expired3")
    redis_client.delete(keys.run("expired3"))
    assert completion.finish_group(redis_client, gid) == "gone"
    assert redis_client.zscore(keys.run_ready("expired3"), gid) is None


def test_a_callback_killed_after_dropping_its_group_is_redone_by_the_redelivery(
        redis_client, tmp_path, monkeypatch):
    """The groups worker dies between the completion script (the group dropped) and the
    TTLs it then sets: the redelivered callback, a duplicate, sets them, or the group's
    record (the whole sample) and results lived for ever."""
    from app.state import retention

    _, gid = setup_group(redis_client, tmp_path, "killed-cb")
    redis_client.hset(keys.group_results(gid), "1", SiblingResult(
        1, f"{gid}.1.x", "failed", None, 1, 0.1, error="agent crashed").to_json())

    class Killed(BaseException):
        pass

    expire = retention.expire_untrained
    monkeypatch.setattr(retention, "expire_untrained",
                        lambda *a: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):  # killed after the drop, before its TTLs
        completion.finish_group(redis_client, gid)
    monkeypatch.setattr(retention, "expire_untrained", expire)
    assert redis_client.hget(keys.group(gid), "status") == "dropped"
    assert redis_client.ttl(keys.group(gid)) == -1
    assert completion.finish_group(redis_client, gid) == "duplicate"
    assert 0 < redis_client.ttl(keys.group(gid)) <= retention.UNTRAINED_TTL_S
    assert 0 < redis_client.ttl(keys.group_results(gid)) <= retention.UNTRAINED_TTL_S

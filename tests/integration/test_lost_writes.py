"""The last second of writes a crash can lose (``appendfsync everysec``): each write of the
step's critical path is made, then lost the way an AOF loses it (the server SIGKILLed and
its AOF cut back to before the write, a suffix, as a machine crash leaves it), and what the
system does after the restart is checked against a real redis-server."""

from __future__ import annotations

import json
import logging
import time

import pytest

from app.driver.collector import Collector
from app.driver.recovery import reassert_selection, repair
from app.state import keys
from app.state.completion import finish_group
from app.state.connection import connect
from app.state.records import GroupRecord, SiblingResult
from tests.integration.test_collector import make_cfg
from tests.unit.test_redis_reconnect import Server

N = 2


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "redis")
    srv.dir.mkdir()
    srv.start()
    yield srv
    srv.stop()


class Crash:
    """Marks the point after which writes are lost; ``lose`` crashes and restarts."""

    def __init__(self, server: Server, client) -> None:
        self.server = server
        self.client = client
        self.aof = server.dir / "appendonly.aof"

    def mark(self) -> None:
        self.client.ping()  # what came before is in the AOF (the server fsyncs always)
        self.size = self.aof.stat().st_size

    def lose(self) -> None:
        """Crash now; every write since ``mark`` is lost."""
        self.server.kill()
        with open(self.aof, "r+b") as f:
            f.truncate(self.size)
        self.server.start()


def make_run(tmp_path, client, groups: int) -> tuple[Collector, list[str]]:
    cfg = make_cfg(tmp_path, [{"sleep": 0} for _ in range(8)], "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=4")
    run_id = "lost-writes"

    Collector.create_run(client, run_id, cfg.to_dict(), "async")
    collector = Collector(client, run_id, cfg)
    gids = []
    for seq in range(groups):
        gid = f"{run_id}-g{seq}"
        rec = GroupRecord(group_id=gid, run_id=run_id, sample_index=seq, sample={"sleep": 0},
                          n=N, seq=seq, dispatch_step=0, dispatch_version=0,
                          dispatched_at=time.time())
        client.hset(keys.group(gid), mapping={**rec.to_hash(), "sent": "1"})  # chord sent
        client.zadd(keys.run_active(run_id), {gid: seq})
        for i in range(N):
            res = SiblingResult(index=i, rollout_id=f"{gid}-r{i}", status="ok", reward=1.0,
                                attempts=1, seconds=0.1, finished_at=time.time())
            client.hset(keys.group_results(gid), str(i), res.to_json())
        client.hincrby(keys.run(run_id), "finished_active", N)
        gids.append(gid)
    return collector, gids


def test_a_lost_completion_mark_is_completed_again_from_the_sibling_results(
        server, tmp_path, caplog):
    client = connect(server.url)
    collector, gids = make_run(tmp_path, client, 2)
    crash = Crash(server, client)
    crash.mark()
    assert finish_group(client, gids[0]) == "complete"
    crash.lose()
    assert client.zcard(keys.run_ready(collector.run_id)) == 0  # the mark was lost
    assert not client.exists(keys.group_done(gids[0]))
    caplog.set_level(logging.WARNING)
    redone = repair(client, collector, collector.run_id, (time.time() - 2, time.time()), 0,
                    None, None)
    assert redone["completed_again"] == 2  # both groups hold all their results
    assert client.zrange(keys.run_ready(collector.run_id), 0, -1) == gids
    assert any("completed_again 2" in r.getMessage() for r in caplog.records)
    # done once: a late callback (the message redelivered) changes nothing
    assert finish_group(client, gids[0]) == "duplicate"


def test_a_group_whose_chord_was_lost_is_sent_again(server, tmp_path, monkeypatch):
    """The lost suffix began after the group's record and before its chord (or its
    ``sent`` mark): nothing would ever run it, and a sync run would wait for it for ever."""
    client = connect(server.url)
    collector, gids = make_run(tmp_path, client, 1)
    crash = Crash(server, client)
    crash.mark()
    pipe = client.pipeline(transaction=True)  # what top_up records before sending
    rec = GroupRecord(group_id="lost-writes-g9", run_id=collector.run_id, sample_index=9,
                      sample={"sleep": 0}, n=N, seq=9)
    pipe.hset(keys.group(rec.group_id), mapping=rec.to_hash())
    pipe.zadd(keys.run_active(collector.run_id), {rec.group_id: 9})
    pipe.execute()
    crash.mark()  # the record is on disk
    client.hset(keys.group(rec.group_id), "sent", "1")  # the chord went; its mark is lost
    crash.lose()
    sent: list[str] = []
    monkeypatch.setattr(collector, "_send", sent.append)
    redone = repair(client, collector, collector.run_id, (time.time() - 2, time.time()), 0,
                    None, None)
    assert redone["resent"] == 1 and sent == [rec.group_id]


def test_a_driver_that_dies_while_dispatching_a_requeued_prompt_loses_no_prompt(
        server, tmp_path, monkeypatch):
    """The re-queued prompt is taken off the queue in the same transaction that records its
    group: a driver that dies before that transaction lands leaves it queued."""
    import redis

    client = connect(server.url)
    collector, _ = make_run(tmp_path, client, 0)
    client.rpush(keys.run_requeue(collector.run_id), "5")

    def dies(self, *args, **kwargs):
        raise redis.ConnectionError("the driver's host went away")

    monkeypatch.setattr(redis.client.Pipeline, "execute", dies)
    with pytest.raises(redis.ConnectionError):
        collector.top_up(0)
    monkeypatch.undo()
    assert client.lrange(keys.run_requeue(collector.run_id), 0, -1) == ["5"]
    sent: list[str] = []
    monkeypatch.setattr(collector, "_send", sent.append)
    assert collector.top_up(0) >= 1  # the resumed driver dispatches it, once
    assert client.llen(keys.run_requeue(collector.run_id)) == 0
    assert client.hget(keys.group(sent[0]), "sample_index") == "5"


def test_a_lost_selection_is_made_again_with_the_same_groups(server, tmp_path):
    client = connect(server.url)
    collector, gids = make_run(tmp_path, client, 3)
    for gid in gids:
        finish_group(client, gid)
    crash = Crash(server, client)
    crash.mark()
    selection = collector.select(0, 0, 0.0)
    chosen = selection.group_ids
    finished_after = int(client.hget(keys.run(collector.run_id), "finished_active"))
    crash.lose()
    run_id = collector.run_id
    assert not client.exists(keys.run_step_groups(run_id, 0))  # the selection was lost
    assert client.zcard(keys.run_ready(run_id)) == 3
    redone = repair(client, collector, run_id, (time.time() - 2, time.time()), 0, chosen, None)
    assert redone["selection"] == 1
    assert client.lrange(keys.run_step_groups(run_id, 0), 0, -1) == chosen
    assert client.zrange(keys.run_ready(run_id), 0, -1) == [gids[2]]
    assert int(client.hget(keys.run(run_id), "finished_active")) == finished_after
    for gid in chosen:
        assert client.hget(keys.group(gid), "status") == "selected"
    # written once: a second look finds it and changes nothing
    assert not reassert_selection(client, run_id, 0, chosen, N)
    assert int(client.hget(keys.run(run_id), "finished_active")) == finished_after


def test_a_selected_group_that_lost_a_sibling_result_is_not_trained_partial(server,
                                                                          tmp_path):
    """The outage took the last sibling result of a selected group with the selection: the
    selection written again leaves that group out, still active, instead of training it
    with a sibling missing."""
    client = connect(server.url)
    collector, gids = make_run(tmp_path, client, 3)
    run_id = collector.run_id
    last = client.hget(keys.group_results(gids[0]), "1")
    client.hdel(keys.group_results(gids[0]), "1")
    client.hincrby(keys.run(run_id), "finished_active", -1)
    crash = Crash(server, client)
    crash.mark()
    from app.state import carry

    carry.store_sibling_result(client, run_id, gids[0], 1, last)
    for gid in gids:
        finish_group(client, gid)
    chosen = collector.select(0, 0, 0.0).group_ids
    assert chosen == gids[:2]
    crash.lose()
    assert client.hlen(keys.group_results(gids[0])) == 1
    redone = repair(client, collector, run_id, (time.time() - 2, time.time()), 0, chosen, None)
    assert redone["selection"] == 1
    assert client.lrange(keys.run_step_groups(run_id, 0), 0, -1) == [gids[1]]
    assert client.hget(keys.group(gids[0]), "status") == "active"
    assert client.zscore(keys.run_active(run_id), gids[0]) is not None


def test_a_lost_step_counter_and_metrics_entry_are_written_again(server, tmp_path):
    client = connect(server.url)
    collector, _ = make_run(tmp_path, client, 1)
    run_id = collector.run_id
    crash = Crash(server, client)
    crash.mark()
    entry = {"step": 0, "timing/step_seconds": 1.0, "training/async/n_completed_rollouts": 4}
    collector.set_step(1)
    client.rpush(keys.run_metrics(run_id), json.dumps(entry))
    crash.lose()
    assert client.llen(keys.run_metrics(run_id)) == 0
    redone = repair(client, collector, run_id, (time.time() - 2, time.time()), 1, None, entry)
    assert redone["step_counter"] == 1 and redone["metrics_entry"] == 1
    assert int(client.hget(keys.run(run_id), "step")) == 1
    assert [json.loads(e) for e in client.lrange(keys.run_metrics(run_id), 0, -1)] == [entry]
    redone = repair(client, collector, run_id, (time.time() - 2, time.time()), 1, None, entry)
    assert redone["metrics_entry"] == 0 and client.llen(keys.run_metrics(run_id)) == 1


def captured(version: int = 0) -> str:
    from app.state.records import CapturedCall

    return CapturedCall(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.7],
                        finish_reason="stop", policy_version=version, temperature=1.0,
                        upstream="u", started_at=time.time(), ended_at=time.time(),
                        endpoint="chat.completions").to_json()


def test_a_lost_captured_call_keeps_its_sibling_out_of_training(server, tmp_path):
    """The agent saw a call whose capture the crash lost and went on; its reward covers that
    call, so its sibling's sample must not be trained from what is left."""
    from app.state.pause import Admission
    from app.state.records import RolloutRecord
    from workers.trainer.batch import collect_samples

    client = connect(server.url)
    admission = Admission(connect(server.url, single_connection=True))
    gid = "g-calls"
    client.hset(keys.group(gid), mapping=GroupRecord(
        group_id=gid, run_id="r", sample_index=0, sample={}, n=2, seq=0, dispatch_step=0,
        dispatch_version=0).to_hash())
    rids = ["r-a", "r-b"]
    for i, rid in enumerate(rids):
        client.hset(keys.rollout(rid), mapping=RolloutRecord(
            rollout_id=rid, run_id="r", group_id=gid, index=i, attempt=1,
            token_sha256="x").to_hash())
        assert admission.record_and_release(admission.admit(rid)[1], [captured()])
    crash = Crash(server, client)
    crash.mark()
    lease = admission.admit("r-a")[1]
    assert admission.record_and_release(lease, [captured()])  # ... lost in the crash
    began = time.time()
    crash.lose()
    assert client.llen(keys.rollout_calls("r-a")) == 1
    assert admission.check_lost_captures(began, time.time()) == ["r-a"]
    # the agent ends after the restart and its result is stored
    for i, rid in enumerate(rids):
        client.hset(keys.group_results(gid), str(i), SiblingResult(
            index=i, rollout_id=rid, status="ok", reward=1.0, attempts=1,
            seconds=0.1).to_json())
    samples, stats = collect_samples(client, [gid], zero_reward_failures=False)
    assert {s.rollout_id for s in samples} == {"r-b"}
    assert stats.excluded_samples >= 1
    # a rollout whose captures are all there is left alone
    assert admission.check_lost_captures(began, time.time()) == []

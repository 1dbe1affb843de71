"""The rollout workers' reaper against real Redis: a worker whose alive key is gone has its
unacknowledged tasks requeued, but not by a worker that just rode out a Redis outage, in
which every live worker's key may have expired before it could beat again."""

from __future__ import annotations

import types

import pytest
import redis

from app.state import keys
from workers.rollout import reaper as reaper_module
from workers.rollout.reaper import Reaper

TTL_S = 30.0  # the keys outlive the test; the clock the reaper reads is the test's


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(reaper_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.fixture
def workers(redis_client):
    from app.celery_app import celery_app

    watcher = Reaper(redis_client, celery_app, ttl_s=TTL_S, worker_id="reaper-test:1:a")
    other = Reaper(redis_client, celery_app, ttl_s=TTL_S, worker_id="reaper-test:2:b")
    yield watcher, other
    for w in (watcher, other):
        redis_client.delete(keys.worker_alive(w.worker_id), keys.worker_deliveries(w.worker_id))
        redis_client.srem(keys.rollout_workers(), w.worker_id)


def test_no_reap_for_one_ttl_after_a_failed_beat(workers, clock, redis_client, monkeypatch):
    watcher, other = workers
    other.register()
    redis_client.hset(keys.worker_deliveries(other.worker_id), "tag-1", "task-1")
    # the outage: the watcher's beat fails, and the other's alive key expired meanwhile
    real_beat = watcher.beat
    monkeypatch.setattr(watcher, "beat", lambda: (_ for _ in ()).throw(
        redis.ConnectionError("Redis is restarting")))
    assert watcher.tick(3) == 3
    monkeypatch.setattr(watcher, "beat", real_beat)
    redis_client.delete(keys.worker_alive(other.worker_id))
    clock[0] += 1.0
    assert watcher.tick(3) == 4  # a reap's turn, within a TTL of the failure: none
    assert redis_client.sismember(keys.rollout_workers(), other.worker_id)
    assert redis_client.hget(keys.worker_deliveries(other.worker_id), "tag-1") == "task-1"
    # the other worker beat again within the TTL, as a live one does: not requeued
    clock[0] += TTL_S
    other.beat()
    assert watcher.tick(7) == 8
    assert redis_client.sismember(keys.rollout_workers(), other.worker_id)
    # a worker that stays silent past the TTL is reaped
    redis_client.delete(keys.worker_alive(other.worker_id))
    assert watcher.tick(11) == 12
    assert not redis_client.sismember(keys.rollout_workers(), other.worker_id)
    assert not redis_client.exists(keys.worker_deliveries(other.worker_id))


def test_no_reap_for_one_ttl_after_a_beat_that_waited_out_an_outage(workers, clock,
                                                                      redis_client,
                                                                      monkeypatch):
    """The client rides an outage out inside the command (its reconnect budget), so the
    beat succeeds, late: every other worker's key may have expired meanwhile, as ours did."""
    watcher, other = workers
    watcher.tick(0)  # a beat in good times
    other.register()
    redis_client.hset(keys.worker_deliveries(other.worker_id), "tag-1", "task-1")
    real_beat = watcher.beat

    def blocked_beat():
        clock[0] += 2 * TTL_S  # the command waited for Redis to come back
        real_beat()

    monkeypatch.setattr(watcher, "beat", blocked_beat)
    redis_client.delete(keys.worker_alive(other.worker_id))  # expired in the outage
    assert watcher.tick(3) == 4  # a reap's turn, right after the late beat: none
    monkeypatch.setattr(watcher, "beat", real_beat)
    assert redis_client.hget(keys.worker_deliveries(other.worker_id), "tag-1") == "task-1"
    clock[0] += 1.0
    assert watcher.tick(7) == 8  # still within a TTL of it: none
    assert redis_client.sismember(keys.rollout_workers(), other.worker_id)
    clock[0] += TTL_S  # the other stayed silent a whole TTL since: reaped
    assert watcher.tick(11) == 12
    assert not redis_client.sismember(keys.rollout_workers(), other.worker_id)

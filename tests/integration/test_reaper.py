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


def beat_through(watcher, clock, seconds: float, beats: int) -> int:
    """The watcher's beats every quarter TTL, as its thread makes them, for ``seconds``."""
    for _ in range(round(seconds / (TTL_S / 4))):
        clock[0] += TTL_S / 4
        beats = watcher.tick(beats)
    return beats


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
    other.beat()
    beats = beat_through(watcher, clock, TTL_S, 4)
    assert redis_client.sismember(keys.rollout_workers(), other.worker_id)
    # a worker that stays silent past the TTL is reaped
    redis_client.delete(keys.worker_alive(other.worker_id))
    beat_through(watcher, clock, TTL_S, beats)
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
        # the command waited for Redis to come back: 0.6 TTL, enough for a worker whose
        # last beat was a beat interval (0.25 TTL) older than ours to expire
        clock[0] += 0.6 * TTL_S
        real_beat()

    monkeypatch.setattr(watcher, "beat", blocked_beat)
    redis_client.delete(keys.worker_alive(other.worker_id))  # expired in the outage
    assert watcher.tick(3) == 4  # a reap's turn, right after the late beat: none
    monkeypatch.setattr(watcher, "beat", real_beat)
    assert redis_client.hget(keys.worker_deliveries(other.worker_id), "tag-1") == "task-1"
    beats = beat_through(watcher, clock, 0.75 * TTL_S, 4)  # within a TTL of it: none
    assert redis_client.sismember(keys.rollout_workers(), other.worker_id)
    beat_through(watcher, clock, TTL_S, beats)  # the other stayed silent a TTL since: reaped
    assert not redis_client.sismember(keys.rollout_workers(), other.worker_id)

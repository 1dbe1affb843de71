"""Per-step driver bookkeeping does not grow with the number of active groups: the Redis
commands one step issues are counted (real Redis, chords not sent) at 40 and 4,000 active
groups and must be equal. Time is left to the benchmarks.

Commands are counted on the collector's own connections, not with the server's
``commandstats``: the session's Celery workers and gateway share this Redis and issue
commands of their own at any moment."""

from __future__ import annotations

import json
import os

import redis

from app.config import load_config
from app.driver.collector import Collector
from app.state import keys
from app.state.connection import connect, resolve_redis_url


class CountingConnection(redis.Connection):
    """Counts every command this connection packs (pipelines and transactions included)."""

    sent = 0

    def pack_command(self, *args):
        CountingConnection.sent += 1
        return super().pack_command(*args)

    def pack_commands(self, commands):
        commands = list(commands)
        CountingConnection.sent += len(commands)
        return super().pack_commands(commands)


def counting_client(cfg) -> redis.Redis:
    # no idle health-check PINGs: they depend on the clock, not on the step
    return connect(resolve_redis_url(cfg), connection_class=CountingConnection,
                   health_check_interval=0)


def undispatched_cfg(tmp_path, monkeypatch, samples: int, *overrides: str):
    """A run config over ``samples`` prompts whose chords are never sent (bookkeeping only)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(samples)))
    monkeypatch.setattr(Collector, "_send", lambda self, gid: None)
    return load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                              f"data.train_files={data}", *overrides])


def one_step_cost(tmp_path, active: int, monkeypatch) -> int:
    tmp_path.mkdir()
    cfg = undispatched_cfg(tmp_path, monkeypatch, 50, "data.train_batch_size=4",
                           "actor_rollout_ref.rollout.n=2",
                           "agentlightning.async_rollout.max_carry_over_age_steps=5",
                           f"agentlightning.async_rollout.async_train_batch_size={active}")
    client = counting_client(cfg)
    run_id = f"scale-{tmp_path.name}-{active}"
    Collector.create_run(client, run_id, {}, "async")
    col = Collector(client, run_id, cfg)
    assert col.top_up(0) == active
    # four groups complete (what the chord callback writes)
    for gid in client.zrange(keys.run_active(run_id), 0, 3):
        client.zadd(keys.run_ready(run_id), {gid: client.zscore(keys.run_active(run_id), gid)})
    before = CountingConnection.sent
    prev = col.active_count()
    col.cancel_stale(1)
    col.wait_ready()
    sel = col.select(1, prev, 0.0)
    col.top_up(0)
    col.set_step(2)
    cost = CountingConnection.sent - before
    assert len(sel.group_ids) == 4 and col.active_count() == active
    return cost


def test_step_bookkeeping_is_flat_in_active_groups(redis_client, tmp_path, monkeypatch):
    one_step_cost(tmp_path / "warm", 40, monkeypatch)  # loads the Lua scripts once
    small = one_step_cost(tmp_path / "small", 40, monkeypatch)
    large = one_step_cost(tmp_path / "large", 4000, monkeypatch)
    assert small == large, (small, large)
    assert small < 120


def test_age_cap_cancels_every_stale_group_oldest_first(redis_client, tmp_path, monkeypatch):
    cfg = undispatched_cfg(tmp_path, monkeypatch, 20, "data.train_batch_size=2",
                           "data.shuffle=false",
                           "agentlightning.async_rollout.async_train_batch_size=5",
                           "agentlightning.async_rollout.max_carry_over_age_steps=1")
    Collector.create_run(redis_client, "stale", {}, "async")
    col = Collector(redis_client, "stale", cfg)
    col.top_up(0)  # five groups dispatched at step 0
    redis_client.hset(keys.run("stale"), "step", 1)
    col.top_up(0)  # already full: nothing new
    assert col.cancel_stale(1) == 0  # age 1 is allowed
    assert col.cancel_stale(2) == 5  # all five are too old, none skipped
    assert col.active_count() == 0
    assert redis_client.lrange(keys.run_requeue("stale"), 0, -1) == ["0", "1", "2", "3", "4"]

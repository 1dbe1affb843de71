"""Requeue the rollout messages of a dead rollout worker, without waiting hours.

With Redis as the broker, a message delivered to a worker that dies (SIGKILL, OOM, a lost
host) stays in kombu's ``unacked`` hash until the visibility timeout; ours is 12 hours,
because a shorter one would hand a long-running agent's message to a second worker while the
first still runs it. ``task_reject_on_worker_lost`` does not help a ``threads`` pool (the
whole worker process dies, nobody is left to reject).

So each rollout worker process proves it is alive (``keys.worker_alive``, a short TTL
refreshed by a thread) and records the delivery tag of every message it receives
(``keys.worker_deliveries``). Every live worker's heartbeat thread also reaps: for a worker
whose alive key expired, it puts each of its still-unacknowledged messages back on its queue
with kombu's own ``restore_by_tag`` (a WATCH transaction: two reapers cannot restore one
message twice). The message comes back unchanged (same task id, same chord), the sibling runs
again (siblings are idempotent), and its group completes with all ``n`` results.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING

import redis

from app.state import keys

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

WORKER_ID = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Reaper:
    def __init__(self, client: redis.Redis, app: Celery, ttl_s: float,
                 worker_id: str = WORKER_ID) -> None:
        self.client = client
        self.app = app
        self.ttl_ms = max(int(ttl_s * 1000), 200)
        self.worker_id = worker_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # no reaping before this (time.monotonic()): set one TTL past a failed beat
        self._unsure_until = 0.0
        self._beat_at: float | None = None  # the last beat that succeeded

    # --- this worker ----------------------------------------------------------------

    def beat(self) -> None:
        """Alive for one more TTL; (re-)registered each time, so a worker that was wrongly
        presumed dead, or whose keys were flushed, is watched again."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.worker_alive(self.worker_id), "1", px=self.ttl_ms)
        pipe.sadd(keys.rollout_workers(), self.worker_id)
        pipe.execute()

    def register(self) -> None:
        self.beat()

    def received(self, delivery_tag: str, task_id: str) -> None:
        self.client.hset(keys.worker_deliveries(self.worker_id), delivery_tag, task_id)

    def prune(self) -> int:
        """Forget this worker's deliveries that were acknowledged (no longer unacked)."""
        key = keys.worker_deliveries(self.worker_id)
        tags = self.client.hkeys(key)
        if not tags:
            return 0
        with self.app.connection_for_write() as conn:
            unacked = conn.default_channel.unacked_key
        pending = self.client.hmget(unacked, tags)
        done = [t for t, body in zip(tags, pending, strict=True) if body is None]
        if done:
            self.client.hdel(key, *done)
        return len(done)

    # --- the dead ----------------------------------------------------------------------

    def dead_workers(self) -> list[str]:
        members = sorted(self.client.smembers(keys.rollout_workers()))
        if not members:
            return []
        alive = self.client.mget([keys.worker_alive(w) for w in members])
        return [w for w, a in zip(members, alive, strict=True) if a is None]

    def reap(self) -> int:
        """Requeue the unacknowledged messages of every dead worker; returns how many."""
        dead = self.dead_workers()
        if not dead or not self.client.set(keys.reaper_lock(), self.worker_id, nx=True,
                                           px=30000):
            return 0
        restored = 0
        try:
            with self.app.connection_for_write() as conn:
                channel = conn.default_channel
                for worker in dead:
                    key = keys.worker_deliveries(worker)
                    tags = self.client.hgetall(key)
                    for tag, task_id in tags.items():
                        if self.client.hexists(channel.unacked_key, tag):
                            channel.qos.restore_by_tag(tag, leftmost=True)
                            restored += 1
                            log.warning("rollout worker %s died: requeued its task %s",
                                        worker, task_id)
                    self.client.delete(key)
                    self.client.srem(keys.rollout_workers(), worker)
        finally:
            self.client.delete(keys.reaper_lock())
        return restored

    # --- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        self.register()
        self._thread = threading.Thread(target=self._run, name="rollout-reaper", daemon=True)
        self._thread.start()
        log.info("rollout worker %s: liveness every %.1f s", self.worker_id,
                 self.ttl_ms / 4000)

    def stop(self) -> None:
        """Clean exit: this worker's deliveries are acknowledged or restored by Celery's own
        warm shutdown, so it simply leaves."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.client.delete(keys.worker_alive(self.worker_id),
                           keys.worker_deliveries(self.worker_id))
        self.client.srem(keys.rollout_workers(), self.worker_id)

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(self.ttl_ms / 4000):
            beats = self.tick(beats)

    def tick(self, beats: int) -> int:
        """One beat (and every 4th a reap, every 40th a prune); -> the beats done.

        After a beat that failed (Redis away), or one that came more than half a TTL after
        the last (the client waited the outage out inside the command, or this process
        stalled), no reap for one TTL: the other workers' alive keys may have expired in the
        outage too (a worker's last beat may be a beat interval, a quarter TTL, older than
        ours), and each needs a beat of its own to show it lives; reaped before that, their
        tasks would run twice."""
        try:
            self.beat()
            now = time.monotonic()
            if self._beat_at is not None and now - self._beat_at > self.ttl_ms / 2000:
                self._unsure_until = now + self.ttl_ms / 1000
            self._beat_at = now
            beats += 1
            if beats % 4 == 0 and time.monotonic() >= self._unsure_until:
                self.reap()
            if beats % 40 == 0:
                self.prune()
        except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive a Redis blip
            self._unsure_until = time.monotonic() + self.ttl_ms / 1000
            log.warning("rollout worker liveness: %s: %s", exc.__class__.__name__, exc)
        return beats


_reaper: Reaper | None = None


def start_reaper(client: redis.Redis, app: Celery, ttl_s: float) -> Reaper:
    global _reaper
    if _reaper is None:
        _reaper = Reaper(client, app, ttl_s)
        _reaper.start()
    return _reaper


def running_reaper() -> Reaper | None:
    return _reaper


def stop_reaper() -> None:
    global _reaper
    if _reaper is not None:
        _reaper.stop()
        _reaper = None

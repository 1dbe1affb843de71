"""Leases the trainer keeps alive while it works, so that others notice when it dies.

A trainer task refreshes its heartbeat key (the driver sends the task again when it expires
without a result) and, while it holds the gateway's pause, the pause itself: a SIGKILLed
trainer leaves the gateway paused for at most ``trainer.heartbeat_s``, not for the length of
a step timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from types import TracebackType

import redis

log = logging.getLogger(__name__)

WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


class Beats:
    """Calls each registered beat every ``ttl_s / 4`` from a daemon thread, inside a
    ``with`` block; the heartbeat key is set on entry and deleted on exit."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = max(int(ttl_s * 1000), 100)
        self._beats: dict[str, Callable[[], object]] = {"heartbeat": self._heartbeat}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-beats", daemon=True)

    def _heartbeat(self) -> None:
        self.client.set(self.key, WORKER_ID, px=self.ttl_ms)

    def add(self, name: str, beat: Callable[[], object]) -> None:
        with self._lock:
            self._beats[name] = beat

    def remove(self, name: str) -> None:
        with self._lock:
            self._beats.pop(name, None)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_ms / 4000):
            with self._lock:
                beats = list(self._beats.items())
            for name, beat in beats:
                try:
                    beat()
                except redis.RedisError as exc:  # Redis restarting: the next beat retries
                    log.warning("trainer %s beat failed: %s", name, exc)

    def __enter__(self) -> Beats:
        self._heartbeat()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            pass  # it expires on its own

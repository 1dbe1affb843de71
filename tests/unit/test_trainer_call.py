"""The driver waits on a live trainer however long its update takes; only a task that no
trainer worker took times out (``app.driver.trainer_call``)."""

from __future__ import annotations

import threading
import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from app.driver.trainer_call import TrainerLost, TrainerTimeout, _await


class SlowResult:
    """A Celery result that arrives after ``after_s`` (never when None)."""

    def __init__(self, after_s: float | None) -> None:
        self.due = None if after_s is None else time.monotonic() + after_s

    def ready(self) -> bool:
        return self.due is not None and time.monotonic() >= self.due

    def get(self, timeout: float, **_: object) -> dict:
        if self.ready():
            return {"ok": True}
        time.sleep(timeout)
        raise CeleryTimeout()


def beat(client, key: str, stop: threading.Event) -> None:
    while not stop.is_set():
        client.set(key, 1, px=400)
        time.sleep(0.1)


def test_a_heartbeating_trainer_outlives_the_timeout(redis_client):
    stop = threading.Event()
    t = threading.Thread(target=beat, args=(redis_client, "co:test:hb", stop), daemon=True)
    t.start()
    try:
        # the update takes 2.5 s, five times step_timeout_s; its heartbeat never stops
        assert _await(redis_client, SlowResult(2.5), "co:test:hb", 0.5, 0.1) == {"ok": True}
    finally:
        stop.set()
        t.join()


def test_a_task_nobody_takes_times_out(redis_client):
    with pytest.raises(TrainerTimeout, match="no trainer worker took the task"):
        _await(redis_client, SlowResult(None), "co:test:none", 0.5, 0.1)


def test_a_trainer_whose_heartbeat_stops_is_lost(redis_client):
    redis_client.set("co:test:dead", 1, px=300)
    with pytest.raises(TrainerLost):
        _await(redis_client, SlowResult(None), "co:test:dead", 30, 0.1)

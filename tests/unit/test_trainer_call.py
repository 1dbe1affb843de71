"""The driver waits on a live trainer however long its update takes; only a task that no
trainer worker took times out (``app.driver.trainer_call``)."""

from __future__ import annotations

import threading
import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from app.driver.trainer_call import TrainerLost, TrainerTimeout, _await, glob_escape


class SlowResult:
    """A Celery result that arrives after ``after_s`` (never when None)."""

    def __init__(self, after_s: float | None) -> None:
        self.due = None if after_s is None else time.monotonic() + after_s

    def ready(self) -> bool:
        return self.due is not None and time.monotonic() >= self.due

    def get(self, timeout: float, **_: object) -> dict:
        """As Celery's: returns as soon as the result is there, else times out."""
        end = time.monotonic() + timeout
        if self.due is not None and self.due <= end:
            time.sleep(max(0.0, self.due - time.monotonic()))
            return {"ok": True}
        time.sleep(timeout)
        raise CeleryTimeout()


def beat(client, key: str, stop: threading.Event) -> None:
    # a TTL ten refreshes long: a thread stalled on a loaded machine keeps it alive
    while not stop.is_set():
        client.set(key, 1, px=2000)
        time.sleep(0.2)


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
    # long enough to be seen by the first check on a loaded machine, then it expires
    redis_client.set("co:test:dead", 1, px=2000)
    with pytest.raises(TrainerLost):
        _await(redis_client, SlowResult(None), "co:test:dead", 30, 0.1)


def test_a_task_queued_behind_another_task_of_the_run_waits_for_it(redis_client):
    """A resumed driver's ``init_run`` sits behind the step its dead predecessor sent: the
    worker is busy with the run, so the task is not "taken by nobody"."""
    stop = threading.Event()
    other = "co:run:R[1]:trainer:3"  # the step's heartbeat; the run id has glob characters
    t = threading.Thread(target=beat, args=(redis_client, other, stop), daemon=True)
    t.start()
    try:
        assert _await(redis_client, SlowResult(2.0), "co:run:R[1]:trainer:init", 0.5, 0.1,
                      run_heartbeats=f"co:run:{glob_escape('R[1]')}:trainer:*") == {"ok": True}
    finally:
        stop.set()
        t.join()
    redis_client.delete(other)
    with pytest.raises(TrainerTimeout):  # and with nothing of the run running, it times out
        _await(redis_client, SlowResult(None), "co:run:R[1]:trainer:init", 0.5, 0.1,
               run_heartbeats=f"co:run:{glob_escape('R[1]')}:trainer:*")


def test_a_result_stored_just_after_the_heartbeat_ended_is_taken(redis_client):
    """The worker drops its heartbeat a moment before Celery stores the result: that is a
    finished task, not a dead worker (whose task would be sent again)."""
    redis_client.set("co:test:ending", 1, px=300)
    # the result lands about 0.5 s after the heartbeat is gone
    assert _await(redis_client, SlowResult(0.8), "co:test:ending", 30, 0.1) == {"ok": True}


def test_a_result_given_up_on_is_unsubscribed_at_once(redis_client):
    """Waiting on a result subscribes to it; one the driver gives up on (its worker died,
    the task is sent again) must not stay subscribed until the object is collected, maybe
    after Redis is gone, where Celery's unsubscribe would wait out the reconnect budget."""
    from app.celery_app import celery_app
    from app.driver.trainer_call import _stop_waiting

    result = celery_app.AsyncResult("never-answered-task")
    with pytest.raises(CeleryTimeout):
        result.get(timeout=0.2)
    consumer = celery_app.backend.result_consumer
    key = celery_app.backend.get_key_for_task(result.id)
    assert key in consumer.subscribed_to
    _stop_waiting(celery_app, result)
    assert key not in consumer.subscribed_to
    del result  # and collecting it later touches nothing

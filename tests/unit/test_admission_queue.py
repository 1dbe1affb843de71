"""The gateway's one admission connection per process (gateway/admission.py): a Redis that
does not answer fails the calls queued behind it soon (retryable), a busy one does not."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from gateway import admission
from gateway.errors import GatewayError
from gateway.state import GatewayState


def _state(answer_s: float) -> GatewayState:
    def admit_call(rollout_id: str, token_sha256: str) -> tuple:
        time.sleep(answer_s)
        return ("admitted", "lease", 1, None)

    return SimpleNamespace(admission=SimpleNamespace(admit_call=admit_call))  # type: ignore[return-value]


def _queue(state: GatewayState, calls: int, at: list[float] | None = None
           ) -> list[BaseException | None]:
    outcomes: list[BaseException | None] = []

    def call() -> None:
        try:
            admission._admit_call(state, "r", "t")
            outcomes.append(None)
        except GatewayError as exc:
            outcomes.append(exc)
            if at is not None:
                at.append(time.monotonic())

    threads = [threading.Thread(target=call) for _ in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


def test_a_long_queue_behind_a_redis_that_answers_waits_its_turn():
    """40 calls of 0.1 s each: the last waits about 4 s, twice QUEUE_WAIT_S, and still gets
    in (a burst of held calls at a pause's end is not an outage)."""
    outcomes = _queue(_state(0.1), 40)
    assert outcomes == [None] * 40


def test_calls_behind_a_redis_that_does_not_answer_get_a_retryable_503_soon():
    t, failed_at = time.monotonic(), []
    outcomes = _queue(_state(admission.QUEUE_WAIT_S + 3.0), 4, failed_at)
    failed = [o for o in outcomes if o is not None]
    assert len(failed) == 3 and outcomes.count(None) == 1
    assert all(isinstance(o, GatewayError) and o.status == 503 for o in failed)
    # answered while the first call still waits on Redis, not after it
    assert max(failed_at) - t < admission.QUEUE_WAIT_S + 2.5  # the holder waits 5 s


@pytest.fixture(autouse=True)
def _free_connection():
    yield
    assert admission._held_since[0] == 0.0

"""The gateway's half of the pause protocol (``app.state.pause``): let a model call in.

A call is authenticated and takes its lease in one script; while the trainer holds the pause
it is refused with a retryable error, or held until the pause ends (``gateway.hold``).
"""

from __future__ import annotations

import threading
import time

from app.state import keys
from app.state.cached_reads import gateway_paused
from app.state.connection import RETRIED_ERRORS
from app.state.pause import Admission, AdmitStatus
from gateway.auth import admission_error
from gateway.errors import GatewayError, redis_unreachable, retryable
from gateway.state import GatewayState

__all__ = ["Admission", "admit"]

# The admission connection is one per process: while Redis does not answer, the call that
# waits on it holds it (up to gateway.state.REDIS_WAIT_S); the others get a retryable 503
# after this long instead of queueing behind it one by one.
QUEUE_WAIT_S = 2.0
_admitting = threading.Semaphore(1)


def admit(state: GatewayState, rollout_id: str, token_sha256: str
          ) -> tuple[str, int, float | None]:
    """-> (lease id, policy version, the rollout's own sampling temperature: None for a
    training rollout, set for an evaluation's), or the error that refuses the call."""
    s = state.settings
    deadline = time.monotonic() + s.hold_timeout_s
    while True:
        status, lease_id, version, own = _admit_call(state, rollout_id, token_sha256)
        if status is AdmitStatus.ADMITTED:
            return lease_id, version, own
        if status is AdmitStatus.OVER_CAP:
            raise GatewayError(429, f"rollout {rollout_id!r} already has "
                               f"{s.max_concurrent_per_rollout} requests in flight "
                               "(gateway.max_concurrent_per_rollout)",
                               type_="rate_limit_error", code="too_many_concurrent",
                               retry_after=1.0)
        if status.is_auth_failure:
            rollout_status = "closed"
            if status is AdmitStatus.ROLLOUT_CLOSED:
                rollout_status = state.redis.hget(keys.rollout(rollout_id), "status") or "closed"
            raise admission_error(rollout_id, status, rollout_status)
        if not s.hold or time.monotonic() >= deadline:
            raise retryable("the model is being updated; retry after the pause",
                            state.admission.retry_after_s(s.retry_after_s))
        # Held: wait on this process's view of the flag (one Redis read per 50 ms for all
        # its held requests, not one script per request), then try to get in again.
        time.sleep(0.05)
        while gateway_paused(state.redis, 0.05) and time.monotonic() < deadline:
            time.sleep(0.05)


def _admit_call(state: GatewayState, rollout_id: str, token_sha256: str
                ) -> tuple[AdmitStatus, str, int, float | None]:
    """The admission script, or a retryable 503 when Redis cannot be reached: without it
    neither the token, the pause nor a lease can be checked, so the call is not forwarded."""
    if not _admitting.acquire(timeout=QUEUE_WAIT_S):
        raise redis_unreachable()
    try:
        return state.admission.admit_call(rollout_id, token_sha256)
    except RETRIED_ERRORS as exc:
        raise redis_unreachable() from exc
    finally:
        _admitting.release()

"""The gateway's half of the pause protocol (``app.state.pause``): let a model call in.

A call is authenticated and takes its lease in one script; while the trainer holds the pause
it is refused with a retryable error, or held until the pause ends (``gateway.hold``).
"""

from __future__ import annotations

import threading
import time

import redis

from app.state import keys
from app.state.cached_reads import gateway_paused
from app.state.connection import RETRIED_ERRORS
from app.state.pause import Admission, AdmitStatus
from gateway.auth import admission_error
from gateway.errors import GatewayError, redis_unreachable, retryable
from gateway.state import GatewayState

__all__ = ["Admission", "admit"]

# The admission connection is one per process: while Redis does not answer, the call that
# waits on it holds it (up to gateway.state.REDIS_WAIT_S); once it has held it this long, the
# others get a retryable 503 instead of queueing behind it one by one. A long queue behind a
# Redis that answers (a burst of held calls let in at a pause's end) waits its turn.
QUEUE_WAIT_S = 2.0
_admitting = threading.Lock()
_held_since = [0.0]  # when the current call took the connection (monotonic); 0.0: free


def _take_connection() -> bool:
    """Wait for the admission connection while its holder is getting answers; False once
    the holder has waited on Redis longer than ``QUEUE_WAIT_S``."""
    while not _admitting.acquire(timeout=0.25):
        since = _held_since[0]
        if since and time.monotonic() - since > QUEUE_WAIT_S:
            return False
    _held_since[0] = time.monotonic()
    return True


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
    if not _take_connection():
        raise redis_unreachable()
    try:
        return state.admission.admit_call(rollout_id, token_sha256)
    except redis.AuthenticationError:
        raise  # a wrong password is not an outage to retry through (a 500, logged)
    except RETRIED_ERRORS as exc:
        raise redis_unreachable() from exc
    finally:
        _held_since[0] = 0.0
        _admitting.release()

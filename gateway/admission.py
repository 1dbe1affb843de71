"""The gateway's half of the pause protocol (``app.state.pause``): let a model call in.

A call is authenticated and takes its lease in one script; while the trainer holds the pause
it is refused with a retryable error, or held until the pause ends (``gateway.hold``).
"""

from __future__ import annotations

import time

from app.state import keys
from app.state.cached_reads import gateway_paused
from app.state.pause import Admission, AdmitStatus
from gateway.auth import admission_error
from gateway.errors import GatewayError, retryable
from gateway.state import GatewayState

__all__ = ["Admission", "admit"]


def admit(state: GatewayState, rollout_id: str, token_sha256: str
          ) -> tuple[str, int, float | None]:
    """-> (lease id, policy version, the rollout's own sampling temperature: None for a
    training rollout, set for an evaluation's), or the error that refuses the call."""
    s = state.settings
    deadline = time.monotonic() + s.hold_timeout_s
    while True:
        status, lease_id, version, own = state.admission.admit_call(rollout_id, token_sha256)
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

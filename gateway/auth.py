"""Who may call what: the bearer header, rollout tokens, the admin token.

Agents hold per-rollout tokens only (stored hashed in the rollout's record); the admin token
is never an agent's. Model calls check the rollout token inside the admission script (one
Redis round trip on the hot path): :func:`rollout_token_sha256` and :func:`admission_error`
are its two ends. The routes off the hot path call :func:`authenticate`.
"""

from __future__ import annotations

import hashlib
import hmac

from flask import request

from app.state import keys
from app.state.pause import AdmitStatus
from gateway.errors import GatewayError
from gateway.state import get_state


def bearer() -> str:
    """The token of ``Authorization: Bearer <token>``, or '' when there is none."""
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.startswith("Bearer ") else ""


def rollout_token() -> str:
    """A bearer header, or Anthropic's ``x-api-key``."""
    token = bearer() or request.headers.get("x-api-key", "").strip()
    if not token:
        raise GatewayError(401, "missing bearer token: use the rollout's token as the API key",
                           code="invalid_api_key")
    return token


def rollout_token_sha256() -> str:
    """The caller's rollout token, hashed as the rollout's record stores it."""
    return hashlib.sha256(rollout_token().encode()).hexdigest()


def admission_error(rollout_id: str, status: AdmitStatus, rollout_status: str = "closed"
                    ) -> GatewayError:
    """The error of a status that failed authentication (``status.is_auth_failure``)."""
    if status is AdmitStatus.UNKNOWN_ROLLOUT:
        return GatewayError(404, f"unknown rollout {rollout_id!r}", code="rollout_not_found")
    if status is AdmitStatus.WRONG_TOKEN:
        return GatewayError(401, "token is not valid for this rollout", code="invalid_api_key")
    return GatewayError(409, f"rollout {rollout_id!r} is {rollout_status}; no more model calls",
                        code="rollout_closed")


def authenticate(rollout_id: str) -> None:
    """For the routes off the hot path (models, reward): the caller holds this rollout's
    token and the rollout is still running."""
    state = get_state()
    given = rollout_token_sha256()
    stored, status = state.redis.hmget(keys.rollout(rollout_id), "token_sha256", "status")
    if stored is None:
        raise admission_error(rollout_id, AdmitStatus.UNKNOWN_ROLLOUT)
    if not hmac.compare_digest(given, stored):
        raise admission_error(rollout_id, AdmitStatus.WRONG_TOKEN)
    if status != "running":
        raise admission_error(rollout_id, AdmitStatus.ROLLOUT_CLOSED, status)


def require_admin() -> None:
    token = bearer()
    if not token or not hmac.compare_digest(token, get_state().settings.admin_token):
        raise GatewayError(401, "admin token required (Authorization: Bearer <admin token>)",
                           code="invalid_admin_token")

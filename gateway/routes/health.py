"""``/healthz``: liveness plus what an operator wants at a glance. No auth, no secrets."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from gateway.state import get_state

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> tuple[Response, int]:
    from gateway import __version__

    state = get_state()
    try:
        paused = state.admission.is_paused()
        redis_ok = True
    except Exception:  # noqa: BLE001
        paused, redis_ok = None, False
    body = {"status": "ok" if redis_ok else "degraded", "version": __version__,
            "paused": paused, "redis": redis_ok,
            "upstreams_healthy": len(state.upstreams.healthy()),
            "upstreams": len(state.upstreams.urls)}
    return jsonify(body), (200 if redis_ok else 503)

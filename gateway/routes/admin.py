"""Admin endpoints: pause, drain, resume, state. They need the admin token, which is never
an agent's token (agents hold per-rollout tokens only)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from gateway.auth import require_admin
from gateway.errors import bad_request
from gateway.state import get_state

bp = Blueprint("admin", __name__, url_prefix="/admin")
bp.before_request(require_admin)


def _number(name: str, default: float) -> float:
    body = request.get_json(silent=True) or {}
    value = body.get(name, default) if isinstance(body, dict) else default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise bad_request(f"{name} must be a number >= 0", param=name)
    return float(value)


@bp.post("/pause")
def pause() -> Response:
    state = get_state()
    ttl = _number("pause_ttl_s", 900.0)
    return jsonify({"paused": True, "inflight_at_pause": state.pause.pause(ttl)})


@bp.post("/drain")
def drain() -> Response:
    state = get_state()
    result = state.pause.drain(_number("timeout_s", 30.0))
    return jsonify({"drain_seconds": result.seconds, "cancelled": result.cancelled})


@bp.post("/resume")
def resume() -> Response:
    state = get_state()
    return jsonify({"paused": False, "paused_seconds": state.pause.resume()})


@bp.get("/state")
def show_state() -> Response:
    state = get_state()
    return jsonify({"paused": state.pause.is_paused(),
                    "inflight": state.pause.live_leases(),
                    "upstreams": state.upstreams.urls,
                    "upstreams_healthy": state.upstreams.healthy(),
                    "serves": state.settings.serves})

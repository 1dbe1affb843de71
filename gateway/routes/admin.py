"""Admin endpoints: pause, drain, resume, state. They need the admin token, which is never
an agent's token (agents hold per-rollout tokens only)."""

from __future__ import annotations

import hmac

from flask import Blueprint, current_app, jsonify, request

from gateway.errors import GatewayError, bad_request

bp = Blueprint("admin", __name__, url_prefix="/admin")


@bp.before_request
def _require_admin():
    state = current_app.extensions["carryover"]
    header = request.headers.get("Authorization", "")
    token = header[7:] if header.startswith("Bearer ") else ""
    if not token or not hmac.compare_digest(token, state.settings.admin_token):
        raise GatewayError(401, "admin token required (Authorization: Bearer <admin token>)",
                           code="invalid_admin_token")


def _number(name: str, default: float) -> float:
    body = request.get_json(silent=True) or {}
    value = body.get(name, default) if isinstance(body, dict) else default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise bad_request(f"{name} must be a number >= 0", param=name)
    return float(value)


@bp.post("/pause")
def pause():
    state = current_app.extensions["carryover"]
    ttl = _number("pause_ttl_s", 900.0)
    return jsonify({"paused": True, "inflight_at_pause": state.admission.pause(ttl)})


@bp.post("/drain")
def drain():
    state = current_app.extensions["carryover"]
    result = state.admission.drain(_number("timeout_s", 30.0))
    return jsonify({"drain_seconds": result.seconds, "cancelled": result.cancelled})


@bp.post("/resume")
def resume():
    state = current_app.extensions["carryover"]
    return jsonify({"paused": False, "paused_seconds": state.admission.resume()})


@bp.get("/state")
def get_state():
    state = current_app.extensions["carryover"]
    return jsonify({"paused": state.admission.is_paused(),
                    "inflight": state.admission.live_leases(),
                    "upstreams": state.upstreams.urls,
                    "upstreams_healthy": state.upstreams.healthy()})

"""Per-rollout OpenAI endpoints: ``/rollout/<rollout_id>/v1/...``.

An unmodified agent points the official ``openai`` client at
``<gateway>/rollout/<rollout_id>/v1`` with the rollout's token as its API key; every model
call goes through ``gateway.forward``.
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from gateway.auth import authenticate
from gateway.errors import GatewayError, anthropic_client
from gateway.forward import forward
from gateway.state import get_state

bp = Blueprint("openai", __name__, url_prefix="/rollout/<rollout_id>/v1")


@bp.post("/chat/completions")
def chat_completions(rollout_id: str) -> Response:
    return forward(rollout_id, "chat.completions")


@bp.post("/completions")
def completions(rollout_id: str) -> Response:
    return forward(rollout_id, "completions")


def _model(model: str) -> dict[str, str | int]:
    if anthropic_client():
        return {"type": "model", "id": model, "display_name": model,
                "created_at": "1970-01-01T00:00:00Z"}
    return {"id": model, "object": "model", "created": 0, "owned_by": "carryover"}


@bp.get("/models")
def models(rollout_id: str) -> Response:
    """The served model, in the shape of the SDK that asks (the ``anthropic`` client sends
    ``anthropic-version``, and reads a page of its own)."""
    authenticate(rollout_id)
    model = get_state().settings.model
    if anthropic_client():
        return jsonify({"data": [_model(model)], "has_more": False, "first_id": model,
                        "last_id": model})
    return jsonify({"object": "list", "data": [_model(model)]})


@bp.get("/models/<path:model_id>")
def model(rollout_id: str, model_id: str) -> Response:
    authenticate(rollout_id)
    served = get_state().settings.model
    if model_id != served:
        raise GatewayError(404, f"model {model_id!r} is not served here (only {served!r})",
                           type_="not_found_error", code="model_not_found", param="model")
    return jsonify(_model(served))

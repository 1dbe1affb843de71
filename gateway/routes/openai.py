"""Per-rollout OpenAI endpoints: ``/rollout/<rollout_id>/v1/...``.

An unmodified agent points the official ``openai`` client at
``<gateway>/rollout/<rollout_id>/v1`` with the rollout's token as its API key; every model
call goes through ``gateway.forward``.
"""

from __future__ import annotations

from flask import Blueprint, jsonify

from gateway.auth import authenticate
from gateway.forward import forward
from gateway.state import get_state

bp = Blueprint("openai", __name__, url_prefix="/rollout/<rollout_id>/v1")


@bp.post("/chat/completions")
def chat_completions(rollout_id: str):
    return forward(rollout_id, "chat.completions")


@bp.post("/completions")
def completions(rollout_id: str):
    return forward(rollout_id, "completions")


@bp.get("/models")
def models(rollout_id: str):
    authenticate(rollout_id)
    model = get_state().settings.model
    return jsonify({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "carryover"}]})

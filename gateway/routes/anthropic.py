"""The per-rollout Anthropic Messages endpoint: ``/rollout/<rollout_id>/v1/messages``.

An unmodified ``anthropic`` client (or a Claude-Code-style agent) uses
``<gateway>/rollout/<rollout_id>`` as its base URL and the rollout's token as its API key
(``x-api-key`` or a bearer header); the call is translated to chat completions
(``gateway.protocols.anthropic``) and goes through ``gateway.forward`` like any other.
"""

from __future__ import annotations

from flask import Blueprint, Response

from gateway.forward import forward
from gateway.protocols.anthropic import Messages

bp = Blueprint("anthropic", __name__, url_prefix="/rollout/<rollout_id>/v1")
MESSAGES = Messages()


@bp.post("/messages")
def messages(rollout_id: str) -> Response:
    return forward(rollout_id, "chat.completions", MESSAGES)

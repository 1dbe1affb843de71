"""The per-rollout OpenAI Responses endpoint: ``/rollout/<rollout_id>/v1/responses``.

The OpenAI Agents SDK (and ``client.responses``) uses it by default; the call is translated
to chat completions (``gateway.protocols.responses``) and goes through ``gateway.forward``.
"""

from __future__ import annotations

from flask import Blueprint, Response

from gateway.forward import forward
from gateway.protocols.responses import Responses

bp = Blueprint("responses", __name__, url_prefix="/rollout/<rollout_id>/v1")
RESPONSES = Responses()


@bp.post("/responses")
def responses(rollout_id: str) -> Response:
    return forward(rollout_id, "chat.completions", RESPONSES)

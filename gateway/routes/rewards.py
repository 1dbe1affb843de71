"""``POST /rollout/<rollout_id>/reward``: an agent (any language, any backend) reports its
reward with its rollout token, instead of printing it. Body: ``{"reward": <finite number>}``."""

from __future__ import annotations

import json
import math

from flask import Blueprint, jsonify

from app.state import keys
from gateway.auth import authenticate
from gateway.body import json_body
from gateway.errors import bad_request
from gateway.state import get_state

bp = Blueprint("rewards", __name__, url_prefix="/rollout/<rollout_id>")


@bp.post("/reward")
def post_reward(rollout_id: str):
    authenticate(rollout_id)
    body = json_body()
    value = body.get("reward") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request("'reward' must be a finite number", param="reward")
    get_state().redis.hset(keys.rollout(rollout_id), "reward", json.dumps(float(value)))
    return jsonify({"rollout_id": rollout_id, "reward": float(value)})

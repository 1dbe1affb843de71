"""``POST /rollout/<rollout_id>/reward``: an agent (any language, any backend) reports its
reward with its rollout token, instead of printing it. Body: ``{"reward": <finite number>}``,
at most ``MAX_ABS_REWARD`` in size."""

from __future__ import annotations

import json

from flask import Blueprint, Response, jsonify

from app.state import keys
from app.state.records import MAX_ABS_REWARD, RolloutRecord, checked_reward
from gateway.auth import authenticate
from gateway.body import json_body
from gateway.errors import bad_request
from gateway.state import get_state

bp = Blueprint("rewards", __name__, url_prefix="/rollout/<rollout_id>")


@bp.post("/reward")
def post_reward(rollout_id: str) -> Response:
    authenticate(rollout_id)
    body = json_body()
    value = body.get("reward") if isinstance(body, dict) else None
    try:
        reward = checked_reward(value)
    except ValueError as exc:
        raise bad_request(f"'reward' must be a finite number within +-{MAX_ABS_REWARD:g}; got "
                          f"{exc}", param="reward") from None
    get_state().redis.hset(keys.rollout(rollout_id), RolloutRecord.field("reward"),
                          json.dumps(reward))
    return jsonify({"rollout_id": rollout_id, "reward": reward})

"""Sampling that the trainer can model, enforced or required (``gateway.sampling``).

The trainer scores each sampled token with ``log_softmax(logits / temperature)`` at the
configured rollout temperature. Anything else that shapes vLLM's sampling distribution
(greedy decoding, nucleus and top-k truncation, min-p, penalties, logit biases, banned or
allowed tokens, a minimum length) makes the engine's log-probs differ from what the trainer
computes, so the importance weights would be systematically wrong. Greedy calls
(``temperature: 0``) cannot be trained at all: their sampling probability is not a softmax.

- ``enforce`` (default): the gateway sets these parameters to what the trainer models, as
  Agent Lightning does. The agent's own values are overridden, never silently trained on.
- ``reject``: a call that sets one of them to anything else gets a 400 naming it.

Pure functions: no IO here.
"""

from __future__ import annotations

from typing import Literal

from gateway.bodies import Request
from gateway.errors import bad_request

# parameter -> the values that change nothing
NEUTRAL: dict[str, tuple[float, ...]] = {
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
}
# what enforce sends for each of them
ENFORCED: Request = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "repetition_penalty": 1.0}
# parameters enforce removes (empty or absent changes nothing)
REMOVED: tuple[Literal["logit_bias", "allowed_token_ids", "bad_words", "min_tokens"], ...] = (
    "logit_bias", "allowed_token_ids", "bad_words", "min_tokens")
WHY = "it changes the distribution tokens are sampled from, which the trainer does not model"


def _neutral_removed(value: object) -> bool:
    return value is None or value == 0 or value == {} or value == []


def apply(body: Request, mode: str, temperature: float) -> Request:
    """The request body with sampling the trainer models (``enforce``), or the body as is
    after checking it (``reject``)."""
    if mode == "reject":
        temp = body.get("temperature")
        if temp is not None and float(temp) != temperature:
            greedy = " (greedy decoding cannot be trained)" if float(temp) == 0 else ""
            raise bad_request(
                f"'temperature' {temp} differs from the rollout temperature {temperature} "
                f"the trainer models{greedy}; remove it, or set gateway.sampling: enforce",
                param="temperature")
        for name, neutral in NEUTRAL.items():
            value = body.get(name)
            if value is not None and value not in neutral:
                raise bad_request(f"'{name}' {value!r} is not allowed: {WHY} "
                                  "(gateway.sampling: reject)", param=name)
        for name in REMOVED:
            if not _neutral_removed(body.get(name)):
                raise bad_request(f"'{name}' is not allowed: {WHY} (gateway.sampling: reject)",
                                  param=name)
        return body
    out = body.copy()
    out["temperature"] = temperature
    out.update(ENFORCED)
    for name in REMOVED:
        out.pop(name, None)
    return out

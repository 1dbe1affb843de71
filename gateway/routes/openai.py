"""Per-rollout OpenAI endpoints: ``/rollout/<rollout_id>/v1/...``.

An unmodified agent points the official ``openai`` client at
``<gateway>/rollout/<rollout_id>/v1`` with the rollout's token as its API key. For every call
the gateway: authenticates the token against the rollout, takes an in-flight lease (or
refuses while paused), forwards with token ids and log-probs requested, records the call for
training, releases the lease, and answers in the OpenAI shape.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import requests
from flask import Blueprint, Response, current_app, jsonify, request

from app.state import keys
from gateway import capture
from gateway.errors import GatewayError, bad_request, retryable

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/rollout/<rollout_id>/v1")

ENDPOINT_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


def _state():
    return current_app.extensions["carryover"]


def authenticate(rollout_id: str) -> None:
    state = _state()
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header.startswith("Bearer ") else ""
    if not token:
        raise GatewayError(401, "missing bearer token: use the rollout's token as the API key",
                           code="invalid_api_key")
    stored, status = state.redis.hmget(keys.rollout(rollout_id), "token_sha256", "status")
    if stored is None:
        raise GatewayError(404, f"unknown rollout {rollout_id!r}", code="rollout_not_found")
    given = hashlib.sha256(token.encode()).hexdigest()
    if not hmac.compare_digest(given, stored):
        raise GatewayError(401, "token is not valid for this rollout", code="invalid_api_key")
    if status != "running":
        raise GatewayError(409, f"rollout {rollout_id!r} is {status}; no more model calls",
                           code="rollout_closed")


def _json_body() -> Any:
    # get_data() enforces MAX_CONTENT_LENGTH (413); get_json(silent=True) would hide that.
    raw = request.get_data(cache=True)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None


def _check_int(body: dict, name: str, lo: int, hi: int | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        limit = f" and <= {hi}" if hi is not None else ""
        raise bad_request(f"'{name}' must be an integer >= {lo}{limit}", param=name)


def validate_body(body: Any, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if endpoint == "chat.completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string 'role'",
                                  param="messages")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise bad_request(f"messages[{i}].content must be a string or an array",
                                  param="messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise bad_request("'prompt' must be a string or a non-empty array", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be true or false", param="stream")
    temp = body.get("temperature")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, (int, float))
                             or temp < 0):
        raise bad_request("'temperature' must be a number >= 0", param="temperature")
    _check_int(body, "max_tokens", 1)
    _check_int(body, "max_completion_tokens", 1)
    _check_int(body, "n", 1, 16)
    return body


def _admit(rollout_id: str) -> tuple[str, int]:
    """Take a lease, or refuse retryably while paused (or wait, in hold mode)."""
    state = _state()
    s = state.settings
    deadline = time.monotonic() + s.hold_timeout_s
    while True:
        status, lease_id, version = state.admission.admit(rollout_id)
        if status == 1:
            return lease_id, version
        if status == -1:
            raise GatewayError(429, f"rollout {rollout_id!r} already has "
                               f"{s.max_concurrent_per_rollout} requests in flight "
                               "(gateway.max_concurrent_per_rollout)",
                               type_="rate_limit_error", code="too_many_concurrent",
                               retry_after=1.0)
        wait = state.admission.retry_after_s(s.retry_after_s)
        if not s.hold or time.monotonic() >= deadline:
            raise retryable("the model is being updated; retry after the pause", wait)
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def _forward(rollout_id: str, endpoint: str):
    authenticate(rollout_id)
    body = validate_body(_json_body(), endpoint)
    state = _state()
    s = state.settings
    upstream = state.upstreams.pick(rollout_id)
    if upstream is None:
        raise retryable("no inference server is reachable", s.retry_after_s,
                        code="upstream_unavailable")
    wants_lp, wants_ids = capture.agent_wants(body, endpoint)
    up_body = capture.prepare_upstream_body(body, endpoint, s.model, s.default_max_tokens,
                                            s.default_temperature)
    lease_id, version = _admit(rollout_id)
    cancel = state.leases.add(lease_id)
    started = time.time()
    try:
        resp = _call_upstream(state, upstream + ENDPOINT_PATHS[endpoint], up_body,
                              bool(body.get("stream")), cancel)
    except _Cancelled:
        _release(state, lease_id)
        raise retryable("request cancelled by a weight update; retry", s.retry_after_s,
                        code="cancelled_by_update") from None
    except requests.RequestException as exc:
        _release(state, lease_id)
        state.upstreams.mark_down(upstream)
        raise retryable(f"inference server unreachable ({exc.__class__.__name__})",
                        s.retry_after_s, code="upstream_unavailable") from None
    except BaseException:
        _release(state, lease_id)
        raise
    if resp.status_code >= 400:
        _release(state, lease_id)
        raise _upstream_error(resp)
    meta = dict(endpoint=endpoint, version=version, temperature=float(up_body["temperature"]),
                upstream=upstream, started_at=started)
    if body.get("stream"):
        return Response(_stream(state, resp, rollout_id, lease_id, cancel, meta, wants_lp,
                                wants_ids),
                        mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        data = resp.json()
        if cancel.is_set():
            raise retryable("request cancelled by a weight update; retry", s.retry_after_s,
                            code="cancelled_by_update")
        _record(state, rollout_id, capture.calls_from_response(data, **meta))
    finally:
        _release(state, lease_id)
    return jsonify(capture.strip_for_agent(data, endpoint, wants_lp, wants_ids))


class _Cancelled(Exception):
    pass


def _call_upstream(state, url: str, body: dict, stream: bool, cancel) -> requests.Response:
    """POST upstream; under gevent (gunicorn's worker) the call can be abandoned when a
    drain times out: killing the greenlet closes the socket, which makes vLLM abort it."""
    timeout = (5, state.settings.upstream_timeout_s)
    try:
        import gevent
        from gevent import monkey
    except ImportError:  # pragma: no cover - the gateway always runs under gevent
        gevent = None
    if gevent is None or not monkey.is_module_patched("socket"):
        return state.upstreams.session.post(url, json=body, timeout=timeout, stream=stream)
    job = gevent.spawn(state.upstreams.session.post, url, json=body, timeout=timeout,
                       stream=stream)
    while not job.ready():
        job.join(timeout=0.05)
        if cancel.is_set() and not job.ready():
            job.kill(block=True, timeout=1)
            raise _Cancelled
    return job.get()


def _stream(state, resp: requests.Response, rollout_id: str, lease_id: str, cancel, meta: dict,
            wants_lp: bool, wants_ids: bool) -> Iterator[str]:
    acc = capture.StreamAccumulator(meta["endpoint"])
    done = False
    try:
        for line in resp.iter_lines(decode_unicode=True):
            if cancel.is_set():
                err = retryable("request cancelled by a weight update; retry", 1.0,
                                code="cancelled_by_update")
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            if not line or not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                _record(state, rollout_id,
                        capture.calls_from_response(acc.response(), stream=True, **meta))
                yield "data: [DONE]\n\n"
                continue
            chunk = json.loads(payload)
            acc.add(chunk)
            shown = capture.strip_for_agent(chunk, meta["endpoint"], wants_lp, wants_ids)
            yield f"data: {json.dumps(shown, separators=(',', ':'))}\n\n"
    finally:
        resp.close()
        _release(state, lease_id)
        if not done:
            log.info("stream for %s ended early; nothing captured", rollout_id)


def _record(state, rollout_id: str, calls: list) -> None:
    if not calls:
        return
    # Written before the lease is released: once a drain sees no leases, every admitted
    # call is already in Redis.
    state.redis.rpush(keys.rollout_calls(rollout_id), *[c.to_json() for c in calls])


def _release(state, lease_id: str) -> None:
    state.leases.discard(lease_id)
    state.admission.release(lease_id)


def _upstream_error(resp: requests.Response) -> GatewayError:
    try:
        err = resp.json().get("error", {})
        if isinstance(err, str):
            err = {"message": err}
    except ValueError:
        err = {}
    message = err.get("message") or f"inference server answered {resp.status_code}"
    if resp.status_code < 500:
        return GatewayError(resp.status_code, message, type_=err.get("type") or
                            "invalid_request_error", code=err.get("code"), param=err.get("param"))
    return GatewayError(502, f"inference server error: {message}", type_="server_error",
                        code="upstream_error")


@bp.post("/chat/completions")
def chat_completions(rollout_id: str):
    return _forward(rollout_id, "chat.completions")


@bp.post("/completions")
def completions(rollout_id: str):
    return _forward(rollout_id, "completions")


@bp.get("/models")
def models(rollout_id: str):
    authenticate(rollout_id)
    model = _state().settings.model
    return jsonify({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "carryover"}]})

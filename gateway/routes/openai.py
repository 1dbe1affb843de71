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

import orjson
from flask import Blueprint, Response, current_app, jsonify, request

from app.state import keys
from app.state.cached_reads import gateway_paused, policy_version
from gateway import capture, sampling
from gateway.errors import GatewayError, bad_request, retryable
from gateway.leases import UpstreamCancelled
from gateway.upstream import UpstreamResponse, UpstreamUnreachable

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/rollout/<rollout_id>/v1")

ENDPOINT_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


def _state():
    return current_app.extensions["carryover"]


def _bearer() -> str:
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header.startswith("Bearer ") else ""
    if not token:
        raise GatewayError(401, "missing bearer token: use the rollout's token as the API key",
                           code="invalid_api_key")
    return token


def _auth_error(rollout_id: str, status: int, rollout_status: str = "closed") -> GatewayError:
    if status == -2:
        return GatewayError(404, f"unknown rollout {rollout_id!r}", code="rollout_not_found")
    if status == -3:
        return GatewayError(401, "token is not valid for this rollout", code="invalid_api_key")
    return GatewayError(409, f"rollout {rollout_id!r} is {rollout_status}; no more model calls",
                        code="rollout_closed")


def authenticate(rollout_id: str) -> None:
    """For the routes off the hot path (models, reward); model calls authenticate inside
    the admission script."""
    state = _state()
    token = _bearer()
    stored, status = state.redis.hmget(keys.rollout(rollout_id), "token_sha256", "status")
    if stored is None:
        raise _auth_error(rollout_id, -2)
    given = hashlib.sha256(token.encode()).hexdigest()
    if not hmac.compare_digest(given, stored):
        raise _auth_error(rollout_id, -3)
    if status != "running":
        raise _auth_error(rollout_id, -4, status)


def _loads(raw: bytes) -> Any:
    """orjson (several times faster on the hot path), falling back to the json module for
    what only it reads (NaN and Infinity tokens)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _json_body() -> Any:
    # get_data() enforces MAX_CONTENT_LENGTH (413); get_json(silent=True) would hide that.
    raw = request.get_data(cache=True)
    try:
        return _loads(raw)
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


def _admit(rollout_id: str, token_sha256: str) -> tuple[str, int]:
    """Authenticate and take a lease in one script, or refuse retryably while paused (or
    wait, in hold mode)."""
    state = _state()
    s = state.settings
    deadline = time.monotonic() + s.hold_timeout_s
    while True:
        status, lease_id, version = state.admission.admit(rollout_id, token_sha256)
        if status == 1:
            return lease_id, version
        if status == -1:
            raise GatewayError(429, f"rollout {rollout_id!r} already has "
                               f"{s.max_concurrent_per_rollout} requests in flight "
                               "(gateway.max_concurrent_per_rollout)",
                               type_="rate_limit_error", code="too_many_concurrent",
                               retry_after=1.0)
        if status < -1:
            rollout_status = "closed"
            if status == -4:
                rollout_status = state.redis.hget(keys.rollout(rollout_id), "status") or "closed"
            raise _auth_error(rollout_id, status, rollout_status)
        if not s.hold or time.monotonic() >= deadline:
            raise retryable("the model is being updated; retry after the pause",
                            state.admission.retry_after_s(s.retry_after_s))
        # Held: wait on this process's view of the flag (one Redis read per 50 ms for all
        # its held requests, not one script per request), then try to get in again.
        time.sleep(0.05)
        while gateway_paused(state.redis, 0.05) and time.monotonic() < deadline:
            time.sleep(0.05)


def _cancelled_error(state=None) -> GatewayError:
    # ``state`` inside a streamed answer's generator, which runs outside the app context
    return retryable("request cancelled by a weight update; retry",
                     (state or _state()).settings.retry_after_s, code="cancelled_by_update")


def _forward(rollout_id: str, endpoint: str):
    token = _bearer()
    state = _state()
    s = state.settings
    # Authentication comes first (as in the OpenAI API) and rides in the admission script;
    # a request that then proves malformed gives its lease back.
    lease_id, version = _admit(rollout_id, hashlib.sha256(token.encode()).hexdigest())
    try:
        body = sampling.apply(validate_body(_json_body(), endpoint), s.sampling,
                              s.default_temperature)
        upstream = state.upstreams.pick(rollout_id)
        if upstream is None:
            raise retryable("no inference server is reachable", s.retry_after_s,
                            code="upstream_unavailable")
        wants_lp, wants_ids = capture.agent_wants(body, endpoint)
        up_body = capture.prepare_upstream_body(body, endpoint, s.model, s.default_max_tokens,
                                                s.default_temperature)
        stream = bool(body.get("stream"))
    except BaseException:
        state.admission.release(lease_id)
        raise
    cancel = state.leases.add(lease_id)
    started = time.time()
    try:
        with state.leases.abortable(lease_id):
            resp = state.upstreams.post(upstream, ENDPOINT_PATHS[endpoint],
                                        orjson.dumps(up_body), s.upstream_timeout_s)
            data = None if stream else resp.read()
    except UpstreamCancelled:
        _release(state, lease_id)
        raise _cancelled_error() from None
    except UpstreamUnreachable as exc:
        _release(state, lease_id)
        # Refused or cut connections mean the server is gone (perhaps restarting with its
        # initial weights); a read timeout is only a slow answer.
        state.upstreams.mark_down(upstream, restarted=not exc.timed_out)
        raise retryable(f"inference server unreachable ({exc})",
                        s.retry_after_s, code="upstream_unavailable") from None
    except BaseException:
        _release(state, lease_id)
        raise
    if resp.status >= 400:
        try:
            data = resp.read() if data is None else data
        except UpstreamUnreachable:
            data = b""
        _release(state, lease_id)
        raise _upstream_error(resp.status, data)
    meta = dict(endpoint=endpoint, version=version, temperature=float(up_body["temperature"]),
                upstream=upstream, started_at=started)
    if stream:
        return Response(_stream(state, resp, rollout_id, lease_id, cancel, meta, wants_lp,
                                wants_ids),
                        mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        data = _loads(data)
        # a call frozen across a weight update ends on a later version than it started
        calls = capture.calls_from_response(data, **meta,
                                            version_end=policy_version(state.redis))
    except BaseException:
        _release(state, lease_id)
        raise
    if not _record_and_release(state, lease_id, calls):
        raise _cancelled_error()
    return Response(orjson.dumps(capture.strip_for_agent(data, endpoint, wants_lp, wants_ids)),
                    mimetype="application/json")


def _lines(resp: UpstreamResponse) -> Iterator[str]:
    for line in resp.lines():
        yield line.rstrip(b"\r\n").decode("utf-8")


def _stream(state, resp: UpstreamResponse, rollout_id: str, lease_id: str, cancel,
            meta: dict, wants_lp: bool, wants_ids: bool) -> Iterator[str]:
    acc = capture.StreamAccumulator(meta["endpoint"])
    released = False
    current = meta["version"]
    try:
        for line in _lines(resp):
            # The trainer bumps the version while the engines are frozen and before they
            # resume (gateway.drain_mode keep): the first chunk read under a new version
            # holds the first tokens sampled on it.
            now = policy_version(state.redis)
            if now != current:
                acc.switch(now)
                current = now
            if cancel.is_set():
                yield f"data: {json.dumps(_cancelled_error(state).body())}\n\n"
                return
            if not line or not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                released = True
                calls = capture.calls_from_response(acc.response(), stream=True, **meta,
                                                    version_end=current,
                                                    switches=acc.switches)
                if not _record_and_release(state, lease_id, calls):
                    yield f"data: {json.dumps(_cancelled_error(state).body())}\n\n"
                    return
                yield "data: [DONE]\n\n"
                continue
            chunk = _loads(payload)
            acc.add(chunk)
            shown = capture.strip_for_agent(chunk, meta["endpoint"], wants_lp, wants_ids)
            yield b"data: " + orjson.dumps(shown) + b"\n\n"
    finally:
        resp.release()
        if not released:
            _release(state, lease_id)
            log.info("stream for %s ended early; nothing captured", rollout_id)


def _record_and_release(state, lease_id: str, calls: list) -> bool:
    state.leases.discard(lease_id)
    return state.admission.record_and_release(lease_id, [c.to_json() for c in calls])


def _release(state, lease_id: str) -> None:
    state.leases.discard(lease_id)
    state.admission.release(lease_id)


def _upstream_error(status: int, data: bytes) -> GatewayError:
    try:
        err = _loads(data).get("error", {})
        if isinstance(err, str):
            err = {"message": err}
    except (ValueError, AttributeError):
        err = {}
    message = err.get("message") or f"inference server answered {status}"
    if status < 500:
        return GatewayError(status, message, type_=err.get("type") or
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

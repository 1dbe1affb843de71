"""One request to an inference server under a call's lease, and the error the agent gets
when it fails.

A failed request never leaves its connection held, and its error is one the agent's SDK
acts on: a refused or cut connection, or a server without the version's LoRA adapter, marks
the server down and is retryable (the agent retries elsewhere); a read timeout is only a
slow answer (the server stays); a cancel by a weight update is the retryable
``cancelled_by_update``; vLLM's own errors keep their status and words, a context overflow
its OpenAI code (and a count on the rollout's record).
"""

from __future__ import annotations

import logging

import orjson

from app.state import keys
from app.state.records import RolloutRecord
from gateway.bodies import Request
from gateway.body import loads
from gateway.context import is_vllm_overflow
from gateway.errors import CONTEXT_LENGTH_EXCEEDED, GatewayError, bad_request, retryable
from gateway.leases import UpstreamCancelled
from gateway.state import GatewayState
from gateway.upstream import UpstreamResponse, UpstreamUnreachable

log = logging.getLogger(__name__)

ENDPOINT_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


def send(state: GatewayState, rollout_id: str, lease_id: str, upstream: str, endpoint: str,
         body: Request, stream: bool) -> tuple[UpstreamResponse, bytes | None]:
    """Post one upstream call under the lease; -> (the response, its body unless streamed),
    or the error the agent gets."""
    s = state.settings
    try:
        raw = orjson.dumps(body)
    except TypeError as exc:  # JSON nested past orjson's writer (254 levels; it reads 1024)
        raise bad_request(f"request body cannot be sent on ({exc})") from None
    try:
        with state.leases.abortable(lease_id):
            resp = state.upstreams.post(upstream, ENDPOINT_PATHS[endpoint], raw,
                                        s.upstream_timeout_s)
            data = None if stream else resp.read()
    except UpstreamCancelled:
        raise cancelled(state) from None
    except UpstreamUnreachable as exc:
        # Refused or cut connections mean the server is gone (perhaps restarting with its
        # initial weights); a read timeout is only a slow answer.
        state.upstreams.mark_down(upstream, restarted=not exc.timed_out)
        raise retryable(f"inference server unreachable ({exc})",
                        s.retry_after_s, code="upstream_unavailable") from None
    if resp.status >= 400:
        try:
            data = resp.read() if data is None else data
        except UpstreamUnreachable:
            data = b""
        finally:
            resp.release()
        err = upstream_error(resp.status, data)
        if resp.status == 404 and s.lora and body.get("model") != s.model:
            # a server without the version's adapter (it restarted unseen, or missed a
            # load): stale until the keeper has loaded it; the agent retries elsewhere
            state.upstreams.mark_down(upstream, restarted=True)
            raise retryable(f"inference server lacks adapter {body.get('model')} "
                            f"({err.message})", s.retry_after_s, code="upstream_unavailable")
        if is_vllm_overflow(resp.status, err.message):
            err.code = CONTEXT_LENGTH_EXCEEDED
            raise overflowed(state, rollout_id, err)
        raise err
    return resp, data


def cancelled(state: GatewayState) -> GatewayError:
    """A call a weight update ended (its lease cancelled, or its answer cut and not carried
    on): the agent sends it again."""
    return retryable("request cancelled by a weight update; retry",
                     state.settings.retry_after_s, code="cancelled_by_update")


def overflowed(state: GatewayState, rollout_id: str, err: GatewayError) -> GatewayError:
    """Count the overflow on the rollout's record (the rollout worker reads it when the
    agent ends: ``controller.on_context_overflow``); nothing is captured."""
    state.redis.hincrby(keys.rollout(rollout_id), RolloutRecord.field("context_overflow"), 1)
    log.info("rollout %s: %s", rollout_id, err.message)
    return err


def upstream_error(status: int, data: bytes) -> GatewayError:
    """vLLM's error answer (``status``, body ``data``) as the agent gets it."""
    try:
        value = loads(data)
    except ValueError:
        value = None
    err = value.get("error") if isinstance(value, dict) else None
    if isinstance(err, str):
        err = {"message": err}
    if not isinstance(err, dict):
        err = {}
    message = err.get("message") or f"inference server answered {status}"
    if status < 500:
        # vLLM names its exception's class as the type and repeats the status as the code;
        # the OpenAI API's are snake_case words, which is what clients branch on
        kind, code = err.get("type"), err.get("code")
        if not isinstance(kind, str) or not kind.islower():
            kind = "not_found_error" if status == 404 else "invalid_request_error"
        return GatewayError(status, message, type_=kind,
                            code=code if isinstance(code, str) else None,
                            param=err.get("param"))
    return GatewayError(502, f"inference server error: {message}", type_="server_error",
                        code="upstream_error")


def stream_error(error: object) -> GatewayError:
    """vLLM's error inside a stream (the ``error`` of a chunk) as the agent gets it."""
    body = error if isinstance(error, dict) else {"message": str(error)}
    code = body.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return upstream_error(status, orjson.dumps({"error": body}))

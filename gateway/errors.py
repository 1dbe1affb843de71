"""OpenAI-style errors. Raised anywhere in a request; turned into a response in one place.

Body shape (what the official ``openai`` client parses):
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; on the Messages
route, and to the ``anthropic`` client on any route, Anthropic's
(``{"type": "error", "error": {"type": ..., "message": ...}}``).

A retryable error says so (``x-should-retry: true``, which the openai and anthropic SDKs
obey before their status rules), and so does a 4xx that is not (``false``): they would
otherwise retry a 409, which here means a rollout that has ended.
"""

from __future__ import annotations

from typing import TypedDict

import redis
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """An OpenAI-style error body."""

    error: ErrorDetail


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> ErrorBody:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# the code of a call whose prompt and max_tokens exceed the served context (OpenAI's)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def overflow_error(prompt_tokens: int, max_tokens: int, max_model_len: int, param: str,
                   limit: str = "max_tokens") -> GatewayError:
    """OpenAI's context-length refusal, naming both lengths; ``limit``: the request's
    name for the completion's length."""
    return GatewayError(
        400, f"This model's maximum context length is {max_model_len} tokens; the request "
             f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens "
             f"({prompt_tokens + max_tokens} in all). Shorten the conversation or lower "
             f"{limit}.", code=CONTEXT_LENGTH_EXCEEDED, param=param)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def retryable(message: str, retry_after: float, code: str = "paused") -> GatewayError:
    # 503 + Retry-After: the official openai client retries it (honouring the header).
    return GatewayError(503, message, type_="server_error", code=code, retry_after=retry_after)


def redis_unreachable() -> GatewayError:
    """The gateway could not reach Redis in time: nothing of the call was forwarded or
    recorded (a capture that could not be written is not answered either)."""
    return retryable("the gateway cannot reach its state store (Redis); retry", 1.0,
                     code="state_unavailable")


def anthropic_client() -> bool:
    """The request is an Anthropic one: the Messages route, or any route asked by the
    ``anthropic`` client (which sends ``anthropic-version`` on every request)."""
    return request.path.endswith("/v1/messages") or "/v1/messages/" in request.path \
        or "anthropic-version" in request.headers


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(GatewayError)
    def _gateway_error(exc: GatewayError) -> Response:
        if anthropic_client():
            from gateway.protocols.anthropic import error_body

            resp = jsonify(error_body(exc))
        else:
            resp = jsonify(exc.body())
        resp.status_code = exc.status
        if exc.retry_after is None:
            if exc.status < 500:  # a 5xx keeps the SDKs' own rules (they retry it)
                resp.headers["x-should-retry"] = "false"
        else:
            resp.headers["x-should-retry"] = "true"
            resp.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            resp.headers["Retry-After-Ms"] = str(int(exc.retry_after * 1000))
        return resp

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    def _redis_error(exc: redis.RedisError) -> Response:
        if isinstance(exc, redis.AuthenticationError):
            return _unexpected(exc)  # a wrong password is not an outage to retry through
        return _gateway_error(redis_unreachable())

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        kind = "invalid_request_error" if status < 500 else "server_error"
        message = exc.description or exc.name
        if status == 413:
            message = "request body too large (limit gateway.max_body_bytes)"
        err = GatewayError(status, message, type_=kind, code=exc.name.lower().replace(" ", "_"))
        return _gateway_error(err)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        app.logger.exception("unhandled error")
        return _gateway_error(GatewayError(500, f"internal gateway error: {exc.__class__.__name__}",
                                           type_="server_error", code="internal_error"))

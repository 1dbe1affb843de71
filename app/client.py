"""An agent-side HTTP client that rides through gateway pauses (tenacity-based).

The gateway answers 503 (paused, upstream down) or 429 (too many concurrent calls) with a
``Retry-After`` header while it updates the model; this client waits as told and retries,
for up to ``max_wait_s``. Other errors raise :class:`GatewayHTTPError` at once; a call
whose prompt outgrew the model's context raises :class:`ContextLengthExceeded` (a subclass).

With the official ``openai`` client instead, ``OpenAI(base_url=..., api_key=...,
max_retries=openai_max_retries(max_wait_s))`` rides through pauses: it retries 503/429 and
honours ``Retry-After`` (it caps single waits at 60 s).

The budget comes from ``controller.retry_max_wait_s``: agents get it as ``llm.max_wait_s``
(python controller) or ``$CARRYOVER_MAX_WAIT_S`` (process and Kubernetes agents). It must
cover the longest pause: a drain, the update when the gateway stays paused through it (GPU),
and the weight load; a dead trainer's pause ends after ``trainer.heartbeat_s``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import requests
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

RETRYABLE_STATUS = (429, 502, 503, 504)
DEFAULT_MAX_WAIT_S = 900.0
SHORTEST_RETRY_AFTER_S = 0.2  # the gateway never asks for a shorter wait


def env_max_wait_s() -> float:
    """The retry budget handed to this agent (``$CARRYOVER_MAX_WAIT_S``), else the default."""
    raw = os.environ.get("CARRYOVER_MAX_WAIT_S", "")
    return float(raw) if raw.strip() else DEFAULT_MAX_WAIT_S


def openai_max_retries(max_wait_s: float) -> int:
    """``max_retries`` for the official client that covers ``max_wait_s`` of pause: the
    gateway's ``Retry-After`` is its estimate of the remaining pause, never under 0.2 s."""
    return max(8, math.ceil(max_wait_s / SHORTEST_RETRY_AFTER_S))


class RetryableResponse(Exception):
    def __init__(self, status: int, retry_after: float | None, body: str) -> None:
        super().__init__(f"gateway answered {status}: {body[:200]}")
        self.status = status
        self.retry_after = retry_after


class GatewayHTTPError(Exception):
    def __init__(self, status: int, body: object) -> None:
        super().__init__(f"gateway answered {status}: {body}")
        self.status = status
        self.body = body

    @property
    def code(self) -> str | None:
        """The OpenAI error code of the body, if it has one."""
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) else None


class ContextLengthExceeded(GatewayHTTPError):
    """The prompt plus ``max_tokens`` exceeds the model's context (400,
    ``context_length_exceeded``): the call was not run. Retrying it as it is fails again;
    end the episode (or shorten the conversation)."""


def _wait(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, RetryableResponse) and exc.retry_after is not None:
        return exc.retry_after
    return wait_exponential(multiplier=0.2, max=5)(state)


class GatewayClient:
    def __init__(self, base_url: str, api_key: str, max_wait_s: float | None = None,
                 timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_wait_s = max_wait_s if max_wait_s is not None else env_max_wait_s()
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.retries = 0

    def _once(self, path: str, body: Mapping[str, object]) -> dict[str, object]:
        try:
            resp = self.session.post(self.base_url + path, json=body, timeout=self.timeout_s)
        except requests.ConnectionError as exc:
            raise RetryableResponse(0, None, str(exc)) from None
        if resp.status_code in RETRYABLE_STATUS:
            ms = resp.headers.get("Retry-After-Ms")
            secs = resp.headers.get("Retry-After")
            after = float(ms) / 1000 if ms else (float(secs) if secs else None)
            raise RetryableResponse(resp.status_code, after, resp.text)
        if resp.status_code >= 400:
            try:
                body_out: object = resp.json()
            except ValueError:
                body_out = resp.text
            err = GatewayHTTPError(resp.status_code, body_out)
            if err.code == "context_length_exceeded":
                raise ContextLengthExceeded(resp.status_code, body_out)
            raise err
        return resp.json()

    def post(self, path: str, body: Mapping[str, object]) -> dict[str, object]:
        for attempt in Retrying(retry=retry_if_exception_type(RetryableResponse),
                                wait=_wait, stop=stop_after_delay(self.max_wait_s),
                                reraise=True):
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    self.retries += 1
                return self._once(path, body)
        raise AssertionError("unreachable")

    def chat(self, **body: object) -> dict[str, object]:
        return self.post("/chat/completions", body)

    def completions(self, **body: object) -> dict[str, object]:
        return self.post("/completions", body)

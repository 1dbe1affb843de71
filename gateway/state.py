"""The gateway's per-process resources, and the one way a request reaches them.

Built once by the factory and kept in ``app.extensions``; every blueprint reads it through
:func:`get_state` (as flaskr's blueprints reach their database through ``get_db()``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from flask import Flask, current_app

from gateway.settings import GatewaySettings

EXTENSION = "carryover"
log = logging.getLogger(__name__)
# How long the gateway waits on one Redis command, or one connect: a Redis it cannot reach (a
# partition drops packets without a word, so nothing else fails) then fails the command
# instead of holding the call until the network heals. It also bounds the admission
# connection's reconnects, so that such a call is answered a retryable 503 soon
# (gateway.admission); a restart of Redis shorter than this is ridden out as before.
REDIS_WAIT_S = 10.0


class GatewayState:
    """Redis clients, the pause protocol's gateway half, this process's leases, upstreams."""

    def __init__(self, settings: GatewaySettings) -> None:
        from app.state.connection import connect, outage_for
        from app.state.pause import Admission, Pause
        from gateway.leases import LocalLeases
        from gateway.upstream import Upstreams

        self.settings = settings
        self.redis = connect(settings.redis_url, max_connections=1024,
                             socket_timeout=REDIS_WAIT_S, socket_connect_timeout=REDIS_WAIT_S)
        # Admission and capture (two calls per model call) share one connection
        self.admission = Admission(connect(settings.redis_url, single_connection=True,
                                           reconnect_s=REDIS_WAIT_S,
                                           socket_timeout=REDIS_WAIT_S,
                                           socket_connect_timeout=REDIS_WAIT_S),
                                   settings.lease_ttl_s,
                                   settings.max_concurrent_per_rollout)
        # the admin routes' pause: an operator's, through any gateway process
        self.pause = Pause(self.admission.r, settings.lease_ttl_s)
        self.leases = LocalLeases(self.admission, refresh_every_s=settings.lease_ttl_s / 3)
        self.upstreams = Upstreams(list(settings.upstreams), client=self.redis,
                                   health_every_s=settings.upstream_health_s,
                                   sleep_check=settings.sleep_check,
                                   api_key=settings.inference_api_key)
        self.context = None  # the context-length check (gateway.context_check)
        self.continuity = None  # token continuity (gateway.token_continuity)
        if settings.context_check or settings.token_continuity:
            from gateway.context import ContextCheck, served_tokenizer
            from gateway.continuity import Continuity

            try:
                tokenizer = served_tokenizer(Path(settings.tokenizer_path),
                                             settings.chat_template)
            except Exception as exc:  # noqa: BLE001 - the gateway serves without them
                log.warning("the context-length check and token continuity are off: the "
                            "tokenizer at %s could not be loaded (%s: %s); vLLM's own "
                            "refusals still get the code context_length_exceeded",
                            settings.tokenizer_path, exc.__class__.__name__, exc)
            else:
                if settings.context_check:
                    self.context = ContextCheck(tokenizer, settings.max_model_len)
                if settings.token_continuity:
                    self.continuity = Continuity(tokenizer, self.admission.r)
        # After a Redis outage: mark the rollouts whose captures the crash lost
        outage_for(settings.redis_url).listeners.append(self._after_outage)

    def _after_outage(self, began: float, ended: float) -> None:
        # in a thread of its own: the listener runs inside the command (or the connect) that
        # found Redis back
        threading.Thread(target=self._check_captures, args=(began, ended), daemon=True,
                         name="lost-captures").start()

    def _check_captures(self, began: float, ended: float) -> None:
        try:
            lost = self.admission.check_lost_captures(began, ended)
        except Exception as exc:  # noqa: BLE001 - a later outage checks again
            log.warning("could not check the captures after a Redis outage: %s", exc)
            return
        if lost:
            log.warning("a Redis crash lost captured calls of %d rollout(s), marked so the "
                        "trainer leaves them out: %s", len(lost), ", ".join(lost[:10]))

    def install(self, app: Flask) -> None:
        app.extensions[EXTENSION] = self


def get_state() -> GatewayState:
    """The state of the app handling the current request."""
    state: GatewayState = current_app.extensions[EXTENSION]
    return state

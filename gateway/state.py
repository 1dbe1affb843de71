"""The gateway's per-process resources, and the one way a request reaches them.

Built once by the factory and kept in ``app.extensions``; every blueprint reads it through
:func:`get_state` (as flaskr's blueprints reach their database through ``get_db()``).
"""

from __future__ import annotations

from flask import Flask, current_app

from gateway.settings import GatewaySettings

EXTENSION = "carryover"


class GatewayState:
    """Redis clients, the pause protocol's gateway half, this process's leases, upstreams."""

    def __init__(self, settings: GatewaySettings) -> None:
        from app.state.connection import connect
        from app.state.pause import Admission, Pause
        from gateway.leases import LocalLeases
        from gateway.upstream import Upstreams

        self.settings = settings
        self.redis = connect(settings.redis_url, max_connections=1024)
        # Admission and capture (two calls per model call) share one connection
        self.admission = Admission(connect(settings.redis_url, single_connection=True),
                                   settings.lease_ttl_s,
                                   settings.max_concurrent_per_rollout)
        # the admin routes' pause: an operator's, through any gateway process
        self.pause = Pause(self.admission.r, settings.lease_ttl_s)
        self.leases = LocalLeases(self.admission, refresh_every_s=settings.lease_ttl_s / 3)
        self.upstreams = Upstreams(list(settings.upstreams), client=self.redis,
                                   health_every_s=settings.upstream_health_s)

    def install(self, app: Flask) -> None:
        app.extensions[EXTENSION] = self


def get_state() -> GatewayState:
    """The state of the app handling the current request."""
    state: GatewayState = current_app.extensions[EXTENSION]
    return state

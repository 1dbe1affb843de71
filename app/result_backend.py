"""Celery's Redis result backend, with the project's reconnect policy on its connections.

The backend builds its own redis-py pool (results, the chord counter a sibling bumps when it
returns, the pub/sub a waiting driver listens on). Left as it is, those connections do not
retry at all: a sibling returning during a Redis restart would fail its chord part, and
``result.get`` would lose its subscription. Here the pool gets the same time-bounded retry
as every client ``app.state.connection.connect`` makes (``redis.reconnect_s``). Selected by
the ``app.result_backend:Backend+redis://...`` form of the backend URL in ``app.celery_app``.
"""

from __future__ import annotations

import redis
from celery.backends.redis import RedisBackend

from app.state.connection import reconnect_options


class Backend(RedisBackend):
    def _create_client(self, **params: object) -> redis.Redis:
        # the project's spelling of the URL (a unix socket is socket:// here): one outage
        # tracker per server, shared with the process's other clients
        url = self.app.conf.get("carryover_redis_url") or self.url or ""
        params.update(reconnect_options(url, self.app.conf.get("carryover_reconnect_s")))
        return self._get_client()(connection_pool=self._get_pool(**params))

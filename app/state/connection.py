"""Which Redis to use, and clients for it.

Precedence: ``$REDIS_URL`` (an external Redis, used as is) > ``redis.url`` in the config >
the embedded server at ``redis.host:redis.port``. A password comes from the URL, else
``redis.password``, else ``$REDIS_PASSWORD``.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import redis

DEFAULT_EMBEDDED = ("127.0.0.1", 6390)


def is_external(cfg: Any | None = None) -> bool:
    return bool(os.environ.get("REDIS_URL") or (cfg is not None and cfg.redis.url))


def resolve_redis_url(cfg: Any | None = None) -> str:
    url = os.environ.get("REDIS_URL") or (cfg.redis.url if cfg is not None else None)
    if url:
        return url
    host, port = (cfg.redis.host, cfg.redis.port) if cfg is not None else DEFAULT_EMBEDDED
    password = (cfg.redis.password if cfg is not None else None) or os.environ.get(
        "REDIS_PASSWORD")
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and status output."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def connect(url: str, max_connections: int = 512, single_connection: bool = False,
            **kwargs: Any) -> redis.Redis:
    """A client with string responses and retries on the transient errors a Redis restart
    causes (the AOF brings the data back; callers just need to ride the gap).

    The pool blocks when full instead of raising: a rollout worker runs hundreds of agent
    threads, and redis-py's default pool (100, raising ``MaxConnectionsError``) would fail
    agents for no reason of their own.

    ``single_connection``: every call shares one connection, taken in turn under a lock.
    For short, frequent calls (the gateway's hot path) this skips the pool's per-call
    checkout, which polls the socket before every command."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    opts: dict[str, Any] = {
        "decode_responses": True,
        "health_check_interval": 30,
        "socket_keepalive": True,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=20),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
    }
    if url.startswith("unix://"):
        opts.pop("socket_keepalive")  # a TCP option
    opts.update(kwargs)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=60, **{k: v for k, v in opts.items()
                                                                if k not in ("retry",)})
    return redis.Redis(connection_pool=pool, retry=opts.get("retry"),
                       single_connection_client=single_connection)

"""Redis reads that many threads or greenlets of one process repeat: read once per interval.

A rollout worker runs hundreds of agents whose clocks ask for the gateway's pause flag and
their group's status on every tick; a gateway process holds its paused requests until the
flag clears. Each asks this process's last view, and Redis is read again at most every
``max_age_s`` per key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from app.state import keys

_seen: dict[str, tuple[float, Any]] = {}
_lock = threading.Lock()


def read_cached(key: str, max_age_s: float, read: Callable[[], Any]) -> Any:
    """``read()``, at most every ``max_age_s`` per process for ``key``. While one caller
    reads again, the others get the previous value instead of reading too."""
    now = time.monotonic()
    with _lock:
        seen = _seen.get(key)
        if seen is not None and now - seen[0] < max_age_s:
            return seen[1]
        if seen is not None:
            _seen[key] = (now, seen[1])  # claim the refresh
        if len(_seen) > 4096:  # forget finished groups now and then
            for k, (at, _) in list(_seen.items()):
                if now - at > 60:
                    _seen.pop(k, None)
    value = read()
    with _lock:
        _seen[key] = (now, value)
    return value


def gateway_paused(client: redis.Redis, max_age_s: float) -> bool:
    """The gateway's pause flag as this process last read it (at most ``max_age_s`` old)."""
    return bool(read_cached(keys.paused(), max_age_s, lambda: client.exists(keys.paused())))

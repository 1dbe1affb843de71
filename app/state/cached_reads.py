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
from typing import Any, TypeVar

import redis

from app.state import keys
from app.state.policy import current_version

T = TypeVar("T")

_seen: dict[str, tuple[float, Any]] = {}
_lock = threading.Lock()


def read_cached(key: str, max_age_s: float, read: Callable[[], T]) -> T:
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


# How old a gateway process's view of the policy version may be. The trainer bumps the
# version while the engines are frozen and waits twice this long before resuming them, so
# every token sampled on new weights is seen by the gateway under the new version.
POLICY_VERSION_MAX_AGE_S = 0.02
_version: dict[str, tuple[float, int]] = {}


def policy_version(client: redis.Redis, max_age_s: float = POLICY_VERSION_MAX_AGE_S) -> int:
    """The policy version as this process last read it (at most ``max_age_s`` old). Unlike
    :func:`read_cached`, a caller that finds the value too old reads it itself rather than
    take the previous one while another caller refreshes: a streamed call's version switch
    is placed by this read."""
    now = time.monotonic()
    seen = _version.get("v")
    if seen is not None and now - seen[0] < max_age_s:
        return seen[1]
    value = current_version(client)
    _version["v"] = (now, value)
    return value

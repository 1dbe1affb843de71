"""The inference servers behind the gateway.

A rollout sticks to one upstream (rendezvous hash of its id) so its multi-turn prompts hit
that server's prefix cache; an upstream that fails is skipped for a cool-down and the
rollout moves to the next one in its own ranking.

A server whose connection failed may have restarted with its initial weights, so it is also
added to the shared ``upstreams_stale`` set in Redis, and every gateway process routes around
the members of that set (re-read at most every ``stale_refresh_s``) until the trainer's
upstream keeper has loaded the current weights into it again.
"""

from __future__ import annotations

import hashlib
import threading
import time

import redis
import urllib3

from app.state import keys


class Upstreams:
    def __init__(self, urls: list[str], cooldown_s: float = 5.0, pool_size: int = 64,
                 client: redis.Redis | None = None, stale_refresh_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("at least one inference URL is needed (inference.urls)")
        self.urls = [u.rstrip("/") for u in urls]
        self.cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}
        self.client = client
        self.stale_refresh_s = stale_refresh_s
        self._stale: set[str] = set()
        self._stale_read_at = float("-inf")
        self._lock = threading.Lock()
        # urllib3 directly: ``requests`` cost a third of the gateway's CPU per call.
        # No retries here (the agent retries on our 503), no proxy lookups.
        self.pool = urllib3.PoolManager(num_pools=max(len(self.urls), 1), maxsize=pool_size,
                                        block=False, retries=False)

    def post(self, url: str, body: bytes, timeout_s: float, stream: bool = False
             ) -> urllib3.BaseHTTPResponse:
        """POST JSON; raises ``urllib3.exceptions.HTTPError`` when the server is unreachable."""
        return self.pool.request(
            "POST", url, body=body, headers={"Content-Type": "application/json"},
            timeout=urllib3.Timeout(connect=5.0, read=timeout_s), preload_content=not stream)

    def ranking(self, key: str) -> list[str]:
        def score(url: str) -> bytes:
            return hashlib.blake2b(f"{url}|{key}".encode(), digest_size=8).digest()

        return sorted(self.urls, key=score, reverse=True)

    def stale(self) -> set[str]:
        """URLs waiting for their weights (shared through Redis, cached for a moment)."""
        now = time.monotonic()
        if self.client is not None and now - self._stale_read_at >= self.stale_refresh_s:
            self._stale_read_at = now
            try:
                self._stale = set(self.client.smembers(keys.upstreams_stale()))
            except redis.RedisError:
                pass  # keep the last view; admission fails loudly on its own if Redis is gone
        return self._stale

    def _usable(self, url: str, now: float, stale: set[str]) -> bool:
        return self._down_until.get(url, 0.0) <= now and url not in stale

    def pick(self, key: str) -> str | None:
        now = time.monotonic()
        stale = self.stale()
        with self._lock:
            for url in self.ranking(key):
                if self._usable(url, now, stale):
                    return url
        return None

    def mark_down(self, url: str, restarted: bool = False) -> None:
        """Skip ``url`` for a cool-down; ``restarted`` (its connection was refused or cut)
        also marks it stale for every gateway until its weights are reloaded."""
        with self._lock:
            self._down_until[url] = time.monotonic() + self.cooldown_s
        if restarted and self.client is not None:
            try:
                self.client.sadd(keys.upstreams_stale(), url)
                self._stale.add(url)
            except redis.RedisError:
                pass

    def healthy(self) -> list[str]:
        now = time.monotonic()
        stale = self.stale()
        with self._lock:
            return [u for u in self.urls if self._usable(u, now, stale)]

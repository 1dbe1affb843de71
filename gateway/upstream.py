"""The inference servers behind the gateway.

A rollout sticks to one upstream (rendezvous hash of its id) so its multi-turn prompts hit
that server's prefix cache; an upstream that fails is skipped for a cool-down and the
rollout moves to the next one in its own ranking.
"""

from __future__ import annotations

import hashlib
import threading
import time

import urllib3


class Upstreams:
    def __init__(self, urls: list[str], cooldown_s: float = 5.0, pool_size: int = 64) -> None:
        if not urls:
            raise ValueError("at least one inference URL is needed (inference.urls)")
        self.urls = [u.rstrip("/") for u in urls]
        self.cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}
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

    def pick(self, key: str) -> str | None:
        now = time.monotonic()
        with self._lock:
            for url in self.ranking(key):
                if self._down_until.get(url, 0.0) <= now:
                    return url
        return None

    def mark_down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = time.monotonic() + self.cooldown_s

    def healthy(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [u for u in self.urls if self._down_until.get(u, 0.0) <= now]

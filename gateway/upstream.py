"""The inference servers behind the gateway.

A rollout sticks to one upstream (rendezvous hash of its id) so its multi-turn prompts hit
that server's prefix cache; an upstream that fails is skipped for a cool-down and the
rollout moves to the next one in its own ranking.

Each gateway process also checks every server's ``/health`` every ``health_every_s``: one
that does not answer 200 is skipped until it does again, so a dead engine behind a live HTTP
server, or a server that went away between calls, costs no agent a failed call. One that
answers no connection at all (a partition) also has the calls in flight on it cut off, with a
retryable error: their answers cannot come.

A server whose connection failed, or that answers a proxy's 502 or 504 after it was healthy
(an ingress or proxy in front of a restarting server), may come back with its initial
weights, so it is also added to the shared ``upstreams_stale`` set in Redis, and every
gateway process routes around the members of that set (re-read at most every
``stale_refresh_s``) until the trainer's upstream keeper has loaded the current weights into
it again.

The check also asks each healthy one ``/is_paused`` (and ``/is_sleeping`` where the servers
sleep around updates, ``sleep_check``): an engine paused or asleep while no pause is held was
left so by a trainer that died mid-update. Paused, vLLM schedules no new request (a call sent
there would hang); asleep, it can crash serving one. It is skipped until the keeper has
taken it back.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import redis

from app.state import keys

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# A pooled connection the server has since closed fails like this before any answer byte;
# the request never reached the engine, so it is sent once more on a fresh connection.
_STALE_REUSE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                ConnectionAbortedError)


class ConnectTimeout(TimeoutError):
    """No connection in time: nothing answered the handshake (a partition, a host gone),
    unlike a slow answer on a connection that was made."""


class UpstreamUnreachable(Exception):
    """The inference server could not be reached or stopped answering."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


class UpstreamResponse:
    """An answer from an inference server; ``release()`` hands its connection back."""

    def __init__(self, pool: _ConnectionPool, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse) -> None:
        self._pool, self._conn, self._resp = pool, conn, resp
        self.status = resp.status
        self._released = False

    def read(self) -> bytes:
        data = self._guarded(self._resp.read)
        self._release(reuse=True)
        return data

    def lines(self) -> Iterator[bytes]:
        """The body line by line (server-sent events), as it arrives."""
        while line := self._guarded(self._resp.readline):
            yield line

    def _guarded(self, read: Callable[[], bytes]) -> bytes:
        """``read()``; a failure closes the connection and says whether the server fell
        silent (a slow answer) or cut it (a server that may be restarting)."""
        try:
            return read()
        except TimeoutError as exc:
            self._release(reuse=False)
            raise UpstreamUnreachable("timed out mid-answer", timed_out=True) from exc
        except (OSError, http.client.HTTPException) as exc:
            self._release(reuse=False)
            raise UpstreamUnreachable(f"answer cut off ({exc.__class__.__name__})") from exc
        except BaseException:
            # cancelled mid-read (a drain's UpstreamCancelled, a killed greenlet): closed now,
            # so the server sees its client leave and stops generating
            self._release(reuse=False)
            raise

    def release(self) -> None:
        """Give the connection back; one whose answer was not read to the end is closed."""
        self._release(reuse=self._resp.isclosed())

    def _release(self, reuse: bool) -> None:
        if self._released:
            return
        self._released = True
        self._pool.done(self._conn)
        if reuse and not self._resp.will_close:
            self._pool.put(self._conn)
        else:
            self._conn.close()


class _OneSend:
    """``http.client`` sends a request's head and body in two ``send`` calls; this holds
    the head back and sends both at once (on loopback each send wakes the server)."""

    hold_head = False  # set for a request with a non-empty body: its first send is the head
    _head: bytes | None = None
    aborted = False  # shut by Upstreams.check_health: its server stopped answering

    def send(self, data):  # type: ignore[no-untyped-def]
        if self.hold_head:
            if self._head is None:
                self._head = bytes(data)
                return
            data, self._head, self.hold_head = self._head + bytes(data), None, False
        super().send(data)  # type: ignore[misc]


class _HTTPConnection(_OneSend, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_OneSend, http.client.HTTPSConnection):
    pass


class _ConnectionPool:
    """Keep-alive connections to one server, most recently used first.

    ``http.client`` rather than urllib3: with ``_OneSend`` a request is one ``send``, and a
    pooled connection is reused without polling its socket first (a closed one is caught by
    ``post`` instead). urllib3 does both, and on loopback each send and poll costs the
    gateway about as much as the work it does for the call."""

    def __init__(self, url: str, maxsize: int, api_key: str = "") -> None:
        u = urlsplit(url)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.https = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.https else 80)
        self.maxsize = maxsize
        self._idle: list[http.client.HTTPConnection] = []
        # a call's, until its release; weak, so that a response dropped unreleased (a stream
        # closed before it ran) is still closed when it is collected
        self._busy: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    def get(self) -> tuple[http.client.HTTPConnection, bool]:
        """-> (connection, reused); busy until :meth:`done`."""
        with self._lock:
            conn, reused = (self._idle.pop(), True) if self._idle else (None, False)
        if conn is None:
            conn = self._new(CONNECT_TIMEOUT_S)
        with self._lock:
            self._busy.add(conn)
        return conn, reused

    def done(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(conn)

    def abort_busy(self) -> int:
        """Shut the connections of the calls in flight: a read blocked on one ends at once
        and its call fails as cut off (retryable), instead of waiting out its timeout for
        an answer that cannot come; -> how many."""
        with self._lock:
            busy = list(self._busy)
            for conn in busy:  # under the lock: a call ending meanwhile is not pooled (put)
                conn.aborted = True  # type: ignore[attr-defined]
        for conn in busy:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return len(busy)

    def _new(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = _HTTPSConnection if self.https else _HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s)

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            # a shut connection would fail the next call without a retry (it is aborted)
            if len(self._idle) < self.maxsize and not getattr(conn, "aborted", False):
                self._idle.append(conn)
                return
        conn.close()

    def fetch(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """Status and body of ``GET path`` on a fresh connection (a check must not take,
        or spoil, a connection the calls use)."""
        conn = self._new(timeout_s)
        try:
            try:
                conn.connect()
            except TimeoutError as exc:
                raise ConnectTimeout(f"no connection in {timeout_s:g} s") from exc
            # with the servers' key: a proxy in front may ask for it on every route
            conn.request("GET", path, headers=self.auth)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: bytes, timeout_s: float) -> UpstreamResponse:
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
                   **self.auth}
        while True:
            conn, reused = self.get()
            ok = False
            try:
                if conn.sock is None:
                    conn.connect()  # under CONNECT_TIMEOUT_S
                conn.sock.settimeout(timeout_s)
                conn.hold_head = bool(body)
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                ok = True
                return UpstreamResponse(self, conn, resp)
            except _STALE_REUSE as exc:
                if reused and not getattr(conn, "aborted", False):
                    continue
                raise UpstreamUnreachable(exc.__class__.__name__) from exc
            except TimeoutError as exc:
                # a connect that timed out left no socket; a read timeout is a slow answer
                raise UpstreamUnreachable("timed out", timed_out=conn.sock is not None) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise UpstreamUnreachable(exc.__class__.__name__) from exc
            finally:
                if not ok:  # failed, or cancelled mid-call (UpstreamCancelled): never reuse
                    self.done(conn)
                    conn.close()


# How long a process trusts its copy of the shared stale set: a server marked stale by one
# gateway process is skipped by every other within this.
STALE_REFRESH_S = 0.5


class Upstreams:
    def __init__(self, urls: list[str], cooldown_s: float = 5.0, pool_size: int = 64,
                 client: redis.Redis | None = None, stale_refresh_s: float = STALE_REFRESH_S,
                 health_every_s: float = 0.0, sleep_check: bool = False,
                 api_key: str = "") -> None:
        if not urls:
            raise ValueError("at least one inference URL is needed (inference.urls)")
        self.urls = [u.rstrip("/") for u in urls]
        self.cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}
        self._unhealthy: set[str] = set()
        self._failures: dict[str, int] = {}
        self._seen_healthy: set[str] = set()
        self._held: set[str] = set()   # left paused or asleep with no pause held
        self.sleep_check = sleep_check
        self.health_every_s = health_every_s
        self.client = client
        self.stale_refresh_s = stale_refresh_s
        self._stale: set[str] = set()
        self._unshared: set[str] = set()  # marked stale here, not yet in Redis
        self._stale_read_at = float("-inf")
        self._lock = threading.Lock()
        # No retries here (the agent retries on our 503), no proxy lookups.
        # ``api_key``: the servers' key (vLLM's --api-key), sent on every call
        self._pools = {u: _ConnectionPool(u, pool_size, api_key) for u in self.urls}
        if health_every_s > 0:
            threading.Thread(target=self._check_forever, name="upstream-health",
                             daemon=True).start()

    def post(self, upstream: str, path: str, body: bytes, timeout_s: float
             ) -> UpstreamResponse:
        """POST JSON to one of ``self.urls``; raises :class:`UpstreamUnreachable` when the
        server cannot be reached or times out (connect: 5 s, each read: ``timeout_s``)."""
        return self._pools[upstream].post(path, body, timeout_s)

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
                if self._unshared:  # marked while Redis did not answer: shared now
                    self.client.sadd(keys.upstreams_stale(), *self._unshared)
                    self._unshared.clear()
                self._stale = set(self.client.smembers(keys.upstreams_stale()))
            except redis.RedisError:
                pass  # keep the last view; admission fails loudly on its own if Redis is gone
            self._stale |= self._unshared
        return self._stale

    def _usable(self, url: str, now: float, stale: set[str]) -> bool:
        return (self._down_until.get(url, 0.0) <= now and url not in stale
                and url not in self._unhealthy and url not in self._held)

    def check_health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """GET every server's ``/health``; -> {url: passed}. A server is skipped after two
        failed checks in a row (one slow answer under load is not an outage) or at once when
        it refuses the connection; it is used again as soon as a check passes. A server that
        passed before and now refuses, or answers as a proxy with no server behind it
        (502, 504), also goes into the stale set (it may come back with its initial
        weights); one that has not come up yet does not. A 503 is vLLM's own answer for a
        dead engine, not a restart: skipped, not stale.

        A skipped server that answers no connection (a partition, a host gone) gets no
        answer out to the calls in flight on it either: those are cut off (retryable, the
        agents send them again to another server) rather than left hanging until
        ``upstream_timeout_s`` or a weight update's drain."""
        results = {}
        for url in self.urls:
            refused = unreachable = False
            try:
                status: int | str = self._pools[url].fetch("/health", timeout_s)[0]
            except (ConnectionRefusedError, ConnectionResetError) as exc:
                status, refused = exc.__class__.__name__, True
            except (OSError, http.client.HTTPException) as exc:
                status, unreachable = exc.__class__.__name__, isinstance(exc, ConnectTimeout)
            passed = status == 200
            results[url] = passed
            if passed:
                self._check_held(url, timeout_s)
            with self._lock:
                was_unhealthy = url in self._unhealthy
                # a proxy's 502/504 twice in a row (once may be a hiccup of the proxy)
                went_away = url in self._seen_healthy and (
                    refused or (status in (502, 504) and self._failures.get(url, 0) >= 1))
                self._failures[url] = 0 if passed else self._failures.get(url, 0) + 1
                if passed:
                    self._seen_healthy.add(url)
                    self._unhealthy.discard(url)
                    self._down_until.pop(url, None)
                elif refused or self._failures[url] >= 2:
                    self._unhealthy.add(url)
                now_unhealthy = url in self._unhealthy
            if was_unhealthy and not now_unhealthy:
                log.warning("inference server %s passes its health check again", url)
            elif now_unhealthy and not was_unhealthy:
                log.warning("inference server %s failed its health check (%s); skipped", url,
                            status)
            if went_away:  # not a server still starting up: it may come back fresh
                self.mark_down(url, restarted=True)
            if unreachable and now_unhealthy:
                cut = self._pools[url].abort_busy()
                if cut:
                    log.warning("inference server %s answers no connection: %d calls in "
                                "flight on it cut off (the agents retry them elsewhere)", url,
                                cut)
        return results

    def _check_held(self, url: str, timeout_s: float) -> None:
        routes = ["/is_paused", *(["/is_sleeping"] if self.sleep_check else [])]
        try:
            # the pause read after the engine: a step pauses the gateway before the engines
            # and resumes it after them, so an engine held within a live pause is the
            # step's; the engine read again, as a step may have ended in between
            for _ in range(2):
                held = [r.removeprefix("/is_") for r in routes
                        if self._reports(url, r, timeout_s)]
                paused = self.client is not None and bool(self.client.exists(keys.paused()))
                if not held or paused:
                    break
        except (OSError, http.client.HTTPException, ValueError, redis.RedisError):
            return  # no answer: the health check decides
        orphan = bool(held) and not paused
        with self._lock:
            was = url in self._held
            if orphan:
                self._held.add(url)
            elif not held:
                self._held.discard(url)
        if orphan and not was:
            log.warning("inference server %s is %s with no pause held (a trainer died "
                        "mid-update?); skipped until the keeper takes it back", url,
                        " and ".join(held))
        elif was and not held:
            log.warning("inference server %s serves again", url)

    def _reports(self, url: str, route: str, timeout_s: float) -> bool:
        """The engine answers ``route`` (``/is_paused``) with true; a server without the
        route (no dev mode, no sleep mode) does not."""
        status, body = self._pools[url].fetch(route, timeout_s)
        return status == 200 and json.loads(body).get(route.removeprefix("/")) is True

    def _check_forever(self) -> None:
        while True:
            try:
                self.check_health()
            except Exception:  # noqa: BLE001 - the checker must outlive any one failure
                log.warning("upstream health check failed", exc_info=True)
            time.sleep(self.health_every_s)

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
            self._stale.add(url)  # this process knows at once, whether Redis answers or not
            try:
                self.client.sadd(keys.upstreams_stale(), url)
            except redis.RedisError:
                self._unshared.add(url)  # shared with the next read that reaches Redis

    def healthy(self) -> list[str]:
        now = time.monotonic()
        stale = self.stale()
        with self._lock:
            return [u for u in self.urls if self._usable(u, now, stale)]

"""Which Redis to use, and clients for it.

Precedence: ``$REDIS_URL`` (an external Redis, used as is) > ``redis.url`` in the config >
the embedded server at ``redis.host:redis.port``. For the last two a password comes from
the URL, else ``redis.password``, else ``$REDIS_PASSWORD``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TypedDict
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry

from app.config.schema import Config

log = logging.getLogger(__name__)

DEFAULT_EMBEDDED = ("127.0.0.1", 6390)


def is_external(cfg: Config | None = None) -> bool:
    return bool(os.environ.get("REDIS_URL") or (cfg is not None and cfg.redis.url))


def resolve_redis_url(cfg: Config | None = None) -> str:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    password = (cfg.redis.password if cfg is not None else None) or os.environ.get(
        "REDIS_PASSWORD")
    url = cfg.redis.url if cfg is not None else None
    if url:
        return _with_password(url, password) if password else url
    host, port = (cfg.redis.host, cfg.redis.port) if cfg is not None else DEFAULT_EMBEDDED
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def _with_password(url: str, password: str) -> str:
    """``url`` carrying ``password``, unless it has one of its own."""
    scheme, rest = url.split("://", 1)
    secret = quote(password, safe="")
    if scheme == "unix":
        if "password=" in rest:
            return url
        return f"{url}{'&' if '?' in rest else '?'}password={secret}"
    netloc = rest.split("/", 1)[0]
    if "@" not in netloc:
        return f"{scheme}://:{secret}@{rest}"
    user = netloc.split("@", 1)[0]
    if ":" in user:  # the URL's own password
        return url
    return f"{scheme}://{user}:{secret}@{rest[len(user) + 1:]}"


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and status output."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def reconnect_budget(cfg: Config | None = None) -> float:
    """Seconds a client keeps reconnecting through a Redis outage (``redis.reconnect_s``),
    from ``cfg`` or else the process's service config."""
    if cfg is None:
        from app.config import service_config

        cfg = service_config()
    return float(cfg.redis.reconnect_s)


class Outage:
    """One process's view of its Redis being unreachable, shared by all its clients of one
    server: logged once when it starts and once, with its length, when it ends, however many
    threads and connections see it; the end is also recorded in Redis
    (``keys.redis_outages``) for ``carryover status``. Listeners (the driver) hear about
    each outage that ended, to check what it may have lost."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = redact(url)
        self._lock = threading.Lock()
        self.down_since: float | None = None  # wall-clock time of the first failure
        self.first_error = ""
        self.outages = 0
        self.listeners: list[Callable[[float, float], None]] = []
        # The run_ids of the servers connections connected to (new at each server start), to
        # tell a restart from a connection that was merely closed when a command's only
        # retry was the immediate one (nobody waited through it); the last one seen apart.
        self.server_run_id: str | None = None
        self._servers: set[str] = set()

    def down(self, at: float, error: BaseException, budget_s: float) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since = at
            self.first_error = f"{error.__class__.__name__}: {error}"
        log.warning("Redis at %s unreachable (%s); reconnecting for up to %.0f s "
                    "(redis.reconnect_s)", self.shown, self.first_error, budget_s)

    def up(self) -> None:
        with self._lock:
            if self.down_since is None:
                return
            began, self.down_since = self.down_since, None
            self.outages += 1
            listeners = list(self.listeners)
        ended = time.time()
        log.warning("Redis at %s back after %.1f s", self.shown, ended - began)
        threading.Thread(target=self._record, args=(began, ended), daemon=True,
                         name="redis-outage-record").start()
        _tell(listeners, began, ended)

    def connected(self, run_id: str | None) -> None:
        """A connection connected to the server ``run_id`` (None: unknown). A run_id not seen
        before, after another, is a restart: while an outage is in progress (or one a
        command gave up on) its end reports it (``up``); otherwise nobody waited through it
        (an idle connection closed, or a command's immediate retry worked) and the
        listeners hear of it here, once. Read as each connection connects, so no restart
        falls between two looks at the server."""
        if not run_id:
            return
        with self._lock:
            self.server_run_id = run_id
            new = run_id not in self._servers
            first = not self._servers
            self._servers.add(run_id)
            if not new or first or self.down_since is not None:
                return
            listeners = list(self.listeners)
        now = time.time()
        log.warning("Redis at %s was restarted (its run_id changed) while no command waited "
                    "for it", self.shown)
        _tell(listeners, now, now)

    def gave_up(self, budget_s: float) -> None:
        log.error("Redis at %s still unreachable after %.0f s (redis.reconnect_s): giving up",
                  self.shown, budget_s)

    def _record(self, began: float, ended: float) -> None:
        """Best effort, on a plain client of its own: the thread that saw Redis come back may
        hold the only connection (a single-connection client)."""
        from app.state import keys
        from app.state.records import OutageRecord

        rec = OutageRecord(role=os.environ.get("CARRYOVER_ROLE", "") or os.path.basename(
            sys.argv[0] or "python"), pid=os.getpid(), down_at=began, up_at=ended,
            error=self.first_error)
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=5)
            pipe = client.pipeline(transaction=False)
            pipe.lpush(keys.redis_outages(), rec.to_json())
            pipe.ltrim(keys.redis_outages(), 0, OUTAGES_KEPT - 1)
            pipe.execute()
            client.close()
        except Exception as exc:  # noqa: BLE001 - a record must never break the client
            log.info("could not record the Redis outage: %s", exc)


def _tell(listeners: list[Callable[[float, float], None]], began: float, ended: float) -> None:
    """Each listener in turn; one that raises is logged and fails neither the others nor the
    command (or connect) that found Redis back, which they run inside."""
    for listener in listeners:
        try:
            listener(began, ended)
        except Exception:  # noqa: BLE001 - a listener's bug must not fail a Redis command
            log.exception("a Redis outage listener failed")


OUTAGES_KEPT = 100  # outage records kept in Redis (one per process and outage)
_OUTAGES: dict[str, Outage] = {}
_OUTAGES_LOCK = threading.Lock()


def outage_for(url: str) -> Outage:
    with _OUTAGES_LOCK:
        return _OUTAGES.setdefault(url, Outage(url))


_nesting = threading.local()


class ReconnectRetry(Retry):
    """redis-py's retry, bounded by time instead of a count: a command that meets a dropped
    connection is retried (with a new connection) until Redis answers again or
    ``budget_s`` has passed since its first failure. That covers an AOF-backed restart of
    the embedded server by the supervisor (backoff, start, AOF load) and a failover of a
    managed one, for every command, blocking ones included: a BLPOP that loses its
    connection is sent again and keeps waiting.

    The first retry is immediate and not counted as an outage: a pooled connection the
    server closed while it was idle (a restart long over) fails once and reconnects at once.

    redis-py retries at two levels (a command, and the connect inside it); only the
    outermost one on a thread loops, so the budget is not spent twice. One instance is
    shared by all connections of a pool (redis-py deep-copies the retry it is given)."""

    def __init__(self, budget_s: float, outage: Outage) -> None:
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), retries=-1,
                         supported_errors=RETRIED_ERRORS)
        self.budget_s = float(budget_s)
        self.outage = outage

    def __deepcopy__(self, memo: dict[int, object]) -> ReconnectRetry:
        return self

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        if getattr(_nesting, "depth", 0):
            return do()  # an outer call on this thread retries the whole command
        _nesting.depth = 1
        try:
            return self._loop(do, fail, is_retryable, with_failure_count)
        finally:
            _nesting.depth = 0

    def _loop(self, do, fail, is_retryable, with_failure_count):
        failures = 0
        first_failure = 0.0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                now = time.monotonic()
                if failures == 1:
                    first_failure = now
                elif failures == 2:
                    self.outage.down(time.time() - (now - first_failure), error, self.budget_s)
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                left = self.budget_s - (now - first_failure)
                if left <= 0:
                    self.outage.gave_up(self.budget_s)
                    raise
                if failures > 1:
                    time.sleep(min(self._backoff.compute(failures - 1), left))
            else:
                # an outage a command gave up on ends with the next command that works
                if failures > 1 or self.outage.down_since is not None:
                    self.outage.up()
                return result


# Errors a restart causes: the dropped connection, refused reconnects, replies cut off, and
# the server answering LOADING while it reads its AOF back.
RETRIED_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout,
                  redis.BusyLoadingError)


class ReconnectOptions(TypedDict):
    """redis-py connection options (keyword arguments of a pool's connections)."""

    retry: ReconnectRetry
    retry_on_error: list[type[Exception]]
    redis_connect_func: Callable[[AbstractConnection], None]


def reconnect_options(url: str, reconnect_s: float | None = None) -> ReconnectOptions:
    """redis-py connection options that ride out a Redis restart; for every pool the project
    builds (``connect`` and the Celery result backend's)."""
    budget = reconnect_budget() if reconnect_s is None else float(reconnect_s)
    outage = outage_for(url)
    return {"retry": ReconnectRetry(budget, outage),
            "retry_on_error": list(RETRIED_ERRORS),
            "redis_connect_func": _connect_hook(outage)}


def _connect_hook(outage: Outage) -> Callable[[AbstractConnection], None]:
    """redis-py's handshake, then the server's run_id for the outage: the pool quietly
    replaces a connection the server closed when it is next taken, so a restart that no
    command waited through shows only there."""
    def on_connect(conn: AbstractConnection) -> None:
        conn.on_connect_check_health(check_health=True)
        outage.connected(_server_run_id(conn))

    return on_connect


def _server_run_id(conn: AbstractConnection) -> str | None:
    """The run_id of the server ``conn`` has just connected to; None where INFO is refused
    (an ACL user without @dangerous), which leaves quick restarts unheard. A PING goes
    first, in the same round trip: a server still loading its AOF answers INFO but not
    PING, and its LOADING error takes the command's outage path, which reports the restart
    once, when the server is ready."""
    conn.send_packed_command(conn.pack_commands([("PING",), ("INFO", "server")]))
    conn.read_response()  # BusyLoadingError while loading: redis-py drops the connection
    try:
        reply = conn.read_response()
    except redis.ResponseError:
        return None
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line.split(":", 1)[1].strip()
    return None


def connect(url: str, max_connections: int = 512, single_connection: bool = False,
            reconnect_s: float | None = None, **kwargs: object) -> redis.Redis:
    """A client with string responses that rides out a Redis restart: every command, blocking
    ones included, reconnects and is sent again for up to ``reconnect_s`` seconds (default
    ``redis.reconnect_s`` of the service config). The AOF brings the data back; callers just
    need to ride the gap. ``retry=None`` turns that off (health checks want a quick answer).

    The retry must be the pool's: when a client is built on a pool, redis-py runs every
    command under its *connection's* retry and ignores the client's own (with only
    ``retry_on_error`` set, a connection retries once, at once, so a blocking read died a
    second into a restart).

    The pool blocks when full instead of raising: a rollout worker runs hundreds of agent
    threads, and redis-py's default pool (100, raising ``MaxConnectionsError``) would fail
    agents for no reason of their own.

    ``single_connection``: every call shares one connection, taken in turn under a lock.
    For short, frequent calls (the gateway's hot path) this skips the pool's per-call
    checkout, which polls the socket before every command."""
    opts: dict[str, object] = {
        "decode_responses": True,
        "health_check_interval": 30,
        "socket_keepalive": True,
    }
    if "retry" not in kwargs:
        opts.update(reconnect_options(url, reconnect_s))
    if url.startswith("unix://"):
        opts.pop("socket_keepalive")  # a TCP option
    opts.update(kwargs)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=60, **opts)
    return redis.Redis(connection_pool=pool, single_connection_client=single_connection)

"""The leases held by this gateway process: refreshed while alive, watched for cancellation.

One background thread per process (a greenlet under gunicorn's gevent worker) refreshes
every live lease in a single Redis call, so a long request never loses its lease, and a
killed process's leases simply stop being refreshed and expire.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from app.state.pause import Admission

if TYPE_CHECKING:
    from greenlet import greenlet

log = logging.getLogger(__name__)


class UpstreamCancelled(Exception):
    """Raised inside a request's upstream call when a drain timeout cancels its lease."""


def _current_greenlet() -> greenlet | None:
    try:
        from gevent import getcurrent, monkey
    except ImportError:  # pragma: no cover - the gateway always runs under gevent
        return None
    return getcurrent() if monkey.is_module_patched("socket") else None


class Lease:
    """One admitted call's lease, ended exactly once: recorded (the capture is stored as the
    lease goes) or released (nothing is). Whatever ends it second is a no-op."""

    def __init__(self, leases: LocalLeases, lease_id: str) -> None:
        self.leases = leases
        self.id = lease_id
        self.ended = False
        self.handed_over = False   # a streamed answer's generator ends it, not the route

    def record(self, calls: list[str], turn: tuple[str, str] | None = None) -> bool:
        """Store ``calls`` (JSON) and release; False when a drain cancelled the lease (nothing
        is recorded). ``turn``: keep the call for token continuity."""
        if self.ended:
            return False
        self.ended = True
        self.leases.discard(self.id)
        return self.leases.admission.record_and_release(self.id, calls, turn)

    def release(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.leases.discard(self.id)
        self.leases.admission.release(self.id)


class LocalLeases:
    def __init__(self, admission: Admission, refresh_every_s: float, check_every_s: float = 0.1):
        self.admission = admission
        self.refresh_every_s = refresh_every_s
        self.check_every_s = check_every_s
        self._live: dict[str, threading.Event] = {}
        self._abortable: dict[str, greenlet] = {}   # lease -> greenlet now in its upstream call
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, lease_id: str) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._live[lease_id] = event
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lease-keeper",
                                                daemon=True)
                self._thread.start()
        return event

    @contextlib.contextmanager
    def held(self, lease_id: str) -> Iterator[Lease]:
        """The lease of one call: released on the way out unless it was recorded, or handed
        over (``lease.handed_over = True``) to what ends it later (a stream)."""
        lease = Lease(self, lease_id)
        try:
            yield lease
        finally:
            if not lease.handed_over:
                lease.release()

    def discard(self, lease_id: str) -> None:
        with self._lock:
            self._live.pop(lease_id, None)

    @contextlib.contextmanager
    def abortable(self, lease_id: str) -> Iterator[None]:
        """Inside this block a cancel of the lease kills the upstream call (under gevent the
        greenlet gets :class:`UpstreamCancelled`, which closes the socket, so the engine
        aborts the generation); outside it a cancel only sets the lease's event."""
        glet = _current_greenlet()
        with self._lock:
            event = self._live.get(lease_id)
            if glet is not None:
                self._abortable[lease_id] = glet
        try:
            if event is not None and event.is_set():
                raise UpstreamCancelled
            yield
        finally:
            with self._lock:
                self._abortable.pop(lease_id, None)
        if event is not None and event.is_set():
            raise UpstreamCancelled

    def _cancel(self, lease_id: str, event: threading.Event) -> None:
        event.set()
        with self._lock:
            glet = self._abortable.pop(lease_id, None)
        if glet is not None:
            import gevent

            gevent.kill(glet, UpstreamCancelled)  # raised where it waits on the socket

    def _snapshot(self) -> dict[str, threading.Event]:
        with self._lock:
            return dict(self._live)

    def _run(self) -> None:
        since_refresh = 0.0
        while True:
            threading.Event().wait(self.check_every_s)
            live = self._snapshot()
            if not live:
                continue
            try:
                ids = list(live)
                for lid in self.admission.cancelled_among(ids):
                    self._cancel(lid, live[lid])
                since_refresh += self.check_every_s
                if since_refresh >= self.refresh_every_s:
                    since_refresh = 0.0
                    self.admission.refresh(ids)
            except Exception:  # noqa: BLE001 - Redis blips must not kill the keeper
                log.warning("lease keeper: Redis call failed; retrying", exc_info=True)

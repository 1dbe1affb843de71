"""The leases held by this gateway process: refreshed while alive, watched for cancellation.

One background thread per process (a greenlet under gunicorn's gevent worker) refreshes
every live lease in a single Redis call, so a long request never loses its lease, and a
killed process's leases simply stop being refreshed and expire.
"""

from __future__ import annotations

import logging
import threading

from gateway.admission import Admission

log = logging.getLogger(__name__)


class LocalLeases:
    def __init__(self, admission: Admission, refresh_every_s: float, check_every_s: float = 0.1):
        self.admission = admission
        self.refresh_every_s = refresh_every_s
        self.check_every_s = check_every_s
        self._live: dict[str, threading.Event] = {}
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

    def discard(self, lease_id: str) -> None:
        with self._lock:
            self._live.pop(lease_id, None)

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
                    live[lid].set()
                since_refresh += self.check_every_s
                if since_refresh >= self.refresh_every_s:
                    since_refresh = 0.0
                    self.admission.refresh(ids)
            except Exception:  # noqa: BLE001 - Redis blips must not kill the keeper
                log.warning("lease keeper: Redis call failed; retrying", exc_info=True)

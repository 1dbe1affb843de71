"""One driver per run: a lease in Redis (``keys.run_driver``), refreshed by a thread.

Two drivers of one run would both dispatch with the same sequence numbers and each rewrite
the other's step selections: groups would be selected and never trained. So a driver takes
the run's lease before it touches the run, and a second one (``carryover train --resume``
while the first still runs) waits at most one lease TTL for it (a dead driver's lease runs
out; one that ran on this host and whose process is gone is taken over at once) and is then
refused, naming the holder. A driver whose lease another took over (its own was lost, say
through a long Redis outage) stops before its next write to the run.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

import redis

from app.state import keys

log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0

# KEYS: the lease   ARGV: this driver's id, TTL ms   -> 1 held (kept, or taken again when it
# had run out: a Redis outage longer than the TTL), 0 another driver holds it
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the lease   ARGV: this driver's id
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_HELD_HERE: set[str] = set()  # the leases this process holds


def _pid_space() -> str:
    """This machine's boot and this process's pid namespace: two processes compare pids
    only when these agree (containers may share a hostname, not their pids)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()[:8]
        return f"{boot}-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # no way to tell: never taken over at once


PID_SPACE = _pid_space()


class RunBusy(RuntimeError):
    """Another live driver drives the run."""


class DriverLease:
    def __init__(self, client: redis.Redis, run_id: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.client, self.run_id, self.ttl_s = client, run_id, ttl_s
        self.key = keys.run_driver(run_id)
        self.me = (f"{socket.gethostname()}:{os.getpid()}:{PID_SPACE}:"
                   f"{secrets.token_hex(3)}")
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.key, self.me, int(self.ttl_s * 1000)))

    def acquire(self, poll_s: float = 0.5) -> None:
        """Take the lease, waiting up to one TTL for another driver's to run out; RunBusy
        if it is still held then. Starts the refresh thread."""
        deadline = time.monotonic() + self.ttl_s + 1.0
        while not self._renew():
            holder = self.client.get(self.key)
            if holder and self._dead_here(holder):
                log.info("run %s: its last driver (%s) is gone from this host; taking the "
                         "run over", self.run_id, holder)
                self.client.eval(_RELEASE, 1, self.key, holder)
                continue
            if time.monotonic() > deadline:
                raise RunBusy(f"run {self.run_id} is driven by another driver "
                              f"({self.client.get(self.key)}, refreshed within the last "
                              f"{self.ttl_s:.0f} s): stop it before resuming the run")
            time.sleep(poll_s)
        _HELD_HERE.add(self.me)
        self._thread = threading.Thread(target=self._keep, name="driver-lease", daemon=True)
        self._thread.start()

    @staticmethod
    def _dead_here(holder: str) -> bool:
        """``holder`` ran in this pid namespace of this boot of this host and its process is
        gone (or had this process's pid without being one of its leases: an earlier
        incarnation of a restarted container)."""
        host, pid, space, _ = (holder.split(":", 3) + ["", "", ""])[:4]
        if host != socket.gethostname() or not pid.isdigit() or not PID_SPACE \
                or space != PID_SPACE:
            return False
        if int(pid) == os.getpid():  # an earlier incarnation's, unless this process holds it
            return holder not in _HELD_HERE
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self._renew():
                    log.error("run %s: another driver took the run over (%s); this one "
                              "stops before its next write", self.run_id,
                              self.client.get(self.key))
                    self.lost.set()
                    return
            except redis.RedisError as exc:  # an outage: try again next tick
                log.warning("run %s: driver lease not refreshed (%s)", self.run_id, exc)

    def release(self) -> None:
        _HELD_HERE.discard(self.me)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.client.eval(_RELEASE, 1, self.key, self.me)
        except redis.RedisError:
            pass  # it runs out by itself

"""One driver per run (``app.driver.lease``): a second driver of a live run is refused, one
whose predecessor died on this host takes over at once, and a driver whose lease another
took stops."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from app.driver.lease import PID_SPACE, DriverLease, RunBusy
from app.state import keys


def test_a_second_driver_of_a_live_run_is_refused(redis_client):
    # a TTL the renewal thread (every third of it) keeps on a loaded machine
    first = DriverLease(redis_client, "leased", ttl_s=3.0)
    first.acquire()
    try:
        second = DriverLease(redis_client, "leased", ttl_s=3.0)
        start = time.monotonic()
        with pytest.raises(RunBusy, match=first.me):
            second.acquire(poll_s=0.1)
        assert time.monotonic() - start >= 3.0  # waited a TTL: the first kept it fresh
        assert not first.lost.is_set()
    finally:
        first.release()
    assert not redis_client.exists(keys.run_driver("leased"))
    again = DriverLease(redis_client, "leased", ttl_s=1.0)
    again.acquire()  # free again
    again.release()


def test_the_lease_of_a_driver_that_died_on_this_host_is_taken_at_once(redis_client):
    dead = subprocess.Popen(["true"])
    dead.wait()
    redis_client.set(keys.run_driver("orphaned"),
                     f"{socket.gethostname()}:{dead.pid}:{PID_SPACE}:ab", px=60_000)
    lease = DriverLease(redis_client, "orphaned")
    start = time.monotonic()
    lease.acquire()
    try:
        assert time.monotonic() - start < 5
        assert redis_client.get(keys.run_driver("orphaned")) == lease.me
    finally:
        lease.release()


def test_a_dead_pid_of_another_pid_namespace_proves_nothing(redis_client):
    """Containers can share a hostname (host networking) and not their pids: a holder whose
    pid is not running here may be alive there. Its lease is waited for."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    redis_client.set(keys.run_driver("elsewhere"),
                     f"{socket.gethostname()}:{dead.pid}:other-space:ab", px=60_000)
    with pytest.raises(RunBusy):
        DriverLease(redis_client, "elsewhere", ttl_s=0.5).acquire(poll_s=0.1)


def test_a_driver_whose_lease_was_taken_over_knows_it(redis_client):
    lease = DriverLease(redis_client, "taken", ttl_s=0.6)
    lease.acquire()
    try:
        redis_client.set(keys.run_driver("taken"), "elsewhere:1:cd", px=60_000)
        assert lease.lost.wait(3)
    finally:
        lease.release()
    assert redis_client.get(keys.run_driver("taken")) == "elsewhere:1:cd"  # not its to drop

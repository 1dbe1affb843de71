"""The trainer's pause belongs to the trainer that set it: a drain timeout returns only after
the requests it cancelled have ended, a stale resume leaves a newer pause in place, and a
pause that could not be extended stops the step before any weight is touched."""

from __future__ import annotations

import threading
import time

import pytest

from app.state import keys
from app.state.pause import Admission, AdmitStatus, Pause
from workers.trainer.errors import StepError
from workers.trainer.gateway_pause import require_pause


@pytest.fixture
def clean(redis_client):
    yield redis_client
    Pause(redis_client).resume()  # an operator's resume: clears any pause
    redis_client.delete(keys.leases(), keys.cancelled())


def test_drain_timeout_waits_for_its_cancelled_request_to_close(clean):
    adm = Pause(clean, lease_ttl_s=5)
    status, lease, _ = Admission(clean, lease_ttl_s=5).admit("slowpoke")
    assert status == 1
    closed_at: list[float] = []

    def gateway() -> None:
        """A gateway's watcher: sees the cancel, aborts upstream (0.5 s), releases."""
        gw = Admission(clean, lease_ttl_s=5)
        while not gw.cancelled_among([lease]):
            time.sleep(0.01)
        time.sleep(0.5)
        closed_at.append(time.monotonic())
        gw.release(lease)

    t = threading.Thread(target=gateway, daemon=True)
    t.start()
    assert adm.pause() == 1
    result = adm.drain(0.2)
    returned_at = time.monotonic()
    t.join(5)
    assert result.cancelled == 1 and result.unended == 0
    assert closed_at and returned_at >= closed_at[0]  # not before the request ended


def test_drain_gives_up_on_a_request_that_never_ends(clean):
    adm = Pause(clean, lease_ttl_s=30)
    Admission(clean, lease_ttl_s=30).admit("stuck")
    adm.pause()
    result = adm.drain(0.1, cancel_wait_s=0.3)  # bounded
    # the request's lease is 30 s: a drain that waited for it would take that long
    assert result.cancelled == 1 and result.unended == 1 and result.seconds < 15


def test_a_stale_resume_leaves_a_newer_pause(clean):
    old = Pause(clean)
    old.pause(pause_ttl_s=0.2)
    time.sleep(0.4)  # the old holder's pause expired (it stopped extending it) ...
    new = Pause(clean)
    new.pause(pause_ttl_s=30)  # ... and another trainer paused since
    assert old.resume() == 0.0
    assert new.is_paused() and new.holds_pause() and not old.holds_pause()
    new.resume()
    assert not new.is_paused()  # its own resume ends it


def test_a_lost_pause_stops_the_step_before_the_weights(clean):
    adm = Pause(clean)
    adm.pause(pause_ttl_s=0.2)
    time.sleep(0.4)
    assert adm.extend_pause(0.2) is False  # what the trainer's beat sees
    with pytest.raises(StepError, match="pause was lost before loading"):
        require_pause(adm, "loading the new weights")
    mine = Pause(clean)
    mine.pause(pause_ttl_s=30)
    require_pause(mine, "loading the new weights")  # held: goes on


def test_the_mark_that_carries_cut_calls_on_lives_and_ends_with_its_pause(clean):
    from gateway.continuation import carries_on

    adm = Pause(clean)
    adm.pause(pause_ttl_s=30)
    assert not carries_on(clean)
    adm.carry_on_cut_calls()
    assert carries_on(clean) and clean.get(keys.pause_carries_on()) == adm.pause_token
    assert adm.extend_pause(60)
    assert clean.pttl(keys.pause_carries_on()) > 30_000  # extended with the pause
    other = Pause(clean)
    other.pause(pause_ttl_s=30)    # taken over (an operator's pause): not carried on
    assert not carries_on(clean)
    clean.pexpire(keys.pause_carries_on(), 5_000)
    assert other.extend_pause(60)  # another pause's extension leaves the mark alone
    assert 0 < clean.pttl(keys.pause_carries_on()) <= 5_000
    other.resume()
    assert not carries_on(clean) and not clean.exists(keys.pause_carries_on())
    # a pause's own mark outlives it a lease TTL: a call the update cut whose answer is read
    # after the resume (a step that failed right after ending them) is still carried on,
    # not passed to its agent cut; then it is gone
    adm.pause(pause_ttl_s=30)
    adm.carry_on_cut_calls()
    adm.resume()
    assert carries_on(clean)
    assert 0 < clean.pttl(keys.pause_carries_on()) <= adm.ttl_ms
    clean.pexpire(keys.pause_carries_on(), 1)
    time.sleep(0.05)
    assert not carries_on(clean)


def test_a_rollouts_cap_counts_its_live_leases_only(clean):
    """The per-rollout cap counts the rollout's live leases. Leases a killed gateway never
    released expire out of it even while the agent keeps retrying (each refused retry kept
    a counter alive, and the rollout was refused for good); a long call whose lease is kept
    alive stays counted past the lease TTL."""
    gw = Admission(clean, lease_ttl_s=2, max_per_rollout=2)
    start = time.monotonic()  # the leases expire 2 s after this, or later
    # two calls of a gateway killed before it released them
    assert [gw.admit("orphaned")[0] for _ in range(2)] == [AdmitStatus.ADMITTED] * 2
    admitted_at = None
    while time.monotonic() - start < 8:
        status, lease, _ = gw.admit("orphaned")
        if status == AdmitStatus.ADMITTED:
            admitted_at = time.monotonic() - start
            gw.release(lease)
            break
        assert status == AdmitStatus.OVER_CAP
        time.sleep(0.2)
    assert admitted_at is not None and admitted_at >= 1.9, admitted_at

    # a TTL six refreshes long: a loaded machine may stall the loop a while
    one = Admission(clean, lease_ttl_s=3, max_per_rollout=1)
    status, long_call, _ = one.admit("long")
    assert status == AdmitStatus.ADMITTED
    for _ in range(14):  # 7 s, past twice the TTL, the lease kept alive as the gateway does
        time.sleep(0.5)
        assert one.refresh([long_call]) == 1
        assert one.admit("long")[0] == AdmitStatus.OVER_CAP
    one.release(long_call)
    status, lease, _ = one.admit("long")
    assert status == AdmitStatus.ADMITTED
    one.release(lease)


def test_a_capture_under_a_lease_no_longer_live_is_not_recorded(clean):
    """A gateway that could not keep its lease alive (Redis out of its reach) is no longer
    counted by a drain: its capture, reaching Redis after the lease expired (a write TCP
    resent when a partition healed), is refused, and so is one whose lease a pause dropped."""
    gw = Admission(clean, lease_ttl_s=1)
    status, late, _ = gw.admit("partitioned")
    assert status == AdmitStatus.ADMITTED
    status, dropped, _ = gw.admit("partitioned")
    assert status == AdmitStatus.ADMITTED
    time.sleep(1.2)
    assert not gw.record_and_release(late, ["{}"])
    assert Pause(clean).live_leases() == 0  # drops the expired lease, as a drain does
    assert not gw.record_and_release(dropped, ["{}"])
    assert clean.llen(keys.rollout_calls("partitioned")) == 0
    status, live, _ = gw.admit("partitioned")
    assert gw.record_and_release(live, ["{}"])
    assert clean.llen(keys.rollout_calls("partitioned")) == 1

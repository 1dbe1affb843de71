"""The pause and lease protocol the gateway and the trainer share, all in Redis.

Two roles, one protocol: :class:`Admission` is the gateway's half (admit a call under a
lease, record its capture and release the lease, keep the lease alive, see cancellations),
:class:`Pause` is the half of whoever stops traffic for a weight load (the trainer, and the
gateway's admin routes for an operator): pause, keep the pause, drain or cancel the leases,
resume. Neither role imports the other; both import this module.

Invariants:
- Admission is one Lua script: it checks the pause flag and takes a lease atomically, so a
  request is either counted by ``pause()`` or refused; none slips between the two.
- ``pause()`` sets the flag and counts live leases in one script: the count it returns is
  exactly the set ``drain()`` then waits for.
- Every lease has an expiry (refreshed while its request lives), and the pause flag has one
  too: a dead gateway worker or a dead trainer cannot hold a drain or a pause forever.
- Times come from the Redis server clock (``TIME``), so gateway hosts with skewed clocks agree.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass
from enum import IntEnum

import redis

from app.state import keys

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: paused, leases, rollout_leases, policy_version, rollout
# ARGV: lease_id, ttl_ms, max_per_rollout, token_sha256 ('' = caller already authenticated)
# -> {status, policy_version, the rollout's own sampling temperature ('' or 'null': none)}:
# status as in AdmitStatus. Authentication rides in the same round trip: the gateway's hot
# path is two Redis calls (this one, and RECORD_RELEASE at the end).
ADMIT = _NOW_MS + """
local rec = redis.call('HMGET', KEYS[5], 'token_sha256', 'status', 'temperature')
if ARGV[4] ~= '' then
  if not rec[1] then return {-2, 0} end
  if rec[1] ~= ARGV[4] then return {-3, 0} end
  if rec[2] ~= 'running' then return {-4, 0} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0} end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[3]) then return {-1, 0} end
local expiry = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[3], expiry, ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[2], expiry, ARGV[1])
local v = redis.call('GET', KEYS[4])
return {1, tonumber(v or '0'), rec[3] or ''}
"""

# KEYS: leases, rollout_leases, cancelled, rollout_calls, rollout_turns
# ARGV: lease_id, turn digest ('' = none), tag of the call's response, calls...
# -> the rollout's number of calls after recording them (1 with nothing to record), 0 the
# lease was cancelled by a drain timeout, or is no longer live (past its expiry, or dropped
# as such): nothing is recorded. A gateway that could not keep the lease alive (Redis out
# of its reach) no longer counts in a drain, so a weight load may have run under the call;
# and such a write can arrive long after the gateway gave up on it (TCP resends it once a
# partition heals). The calls are written before the lease goes, in one step: once a drain
# sees no leases, every admitted call is in Redis.
# With no calls it is the plain release. A turn kept for token continuity points at the
# (one) call just recorded: "<its position in rollout_calls>:<tag>".
RECORD_RELEASE = _NOW_MS + """
local cancelled = redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) < now then cancelled = true end
local length = 1
if not cancelled and #ARGV > 3 then
  length = redis.call('RPUSH', KEYS[4], unpack(ARGV, 4))
  -- a week, as the rollout's record: a call that ends after its group's keys were given
  -- their TTL (a cancel in the middle of a rollout's first call) makes the list anew
  if redis.call('TTL', KEYS[4]) == -1 then redis.call('EXPIRE', KEYS[4], 604800) end
  if ARGV[2] ~= '' then
    redis.call('HSET', KEYS[5], ARGV[2], length .. ':' .. ARGV[3])
    -- a week from its first turn; a shorter TTL set since (a cancelled group's) stays
    if redis.call('TTL', KEYS[5]) == -1 then redis.call('EXPIRE', KEYS[5], 604800) end
  end
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
if cancelled then return 0 end
return length
"""

# KEYS: rollout, rollout_calls   ARGV: the number of calls this gateway process recorded
# -> 1 when the rollout still exists, holds fewer calls and was not marked yet: marked now.
MARK_LOST_CAPTURES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[1]) then return 0 end
if redis.call('HGET', KEYS[1], 'calls_lost') == '1' then return 0 end
redis.call('HSET', KEYS[1], 'calls_lost', 1)
return 1
"""

# How long a gateway process remembers what it recorded, to find what a crash lost: the last
# second of writes under appendfsync everysec (2 s when Redis postponed a write), with room.
RECENT_CAPTURES_S = 10.0
LOST_BEFORE_OUTAGE_S = 3.0

# KEYS: leases, then each lease's rollout_leases   ARGV: ttl_ms, lease ids (in that order)
# (XX: never resurrect a released lease)
REFRESH = _NOW_MS + """
local n = 0
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', expiry, ARGV[i]) == 1 then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
  end
end
return n
"""

# KEYS: paused, pause_started, leases   ARGV: token, pause_ttl_ms
PAUSE = _NOW_MS + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[2], now, 'PX', ARGV[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
return redis.call('ZCARD', KEYS[3])
"""

# KEYS: paused, pause_started, pause_carries_on   ARGV: token, pause_ttl_ms
# -> 1 extended, 0 not our pause.
# The pause is a lease: its holder keeps extending it, so it ends soon after the holder dies.
EXTEND_PAUSE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[3]) == ARGV[1] then  -- the carry-on mark, if it is this pause's
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return 1
"""

# KEYS: leases   -> live leases after dropping expired ones
LIVE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""

# KEYS: paused, pause_started, pause_history, pause_carries_on
# ARGV: keep, token ('' = any pause: an operator), carry-on mark's linger ms
# -> pause duration in ms (0 if not paused), -1 when the pause is another holder's: a stale
# resume (a trainer whose pause expired and was taken over) must not end a newer pause.
# The carry-on mark outlives its pause a lease TTL: a call the update cut whose answer a
# gateway reads only after the resume (a step that failed right after its engines ended
# the calls) is carried on too, never passed to its agent cut.
RESUME = _NOW_MS + """
local holder = redis.call('GET', KEYS[1])
if ARGV[2] ~= '' and holder and holder ~= ARGV[2] then return -1 end
local started = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2])
local mark = redis.call('GET', KEYS[4])
if mark and holder and mark == holder then
  redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[3]))
elseif mark then
  redis.call('DEL', KEYS[4])  -- an older pause's: ended with the pause that followed it
end
if not started then return 0 end
local dur = now - tonumber(started)
redis.call('LPUSH', KEYS[3], dur)
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[1]) - 1)
return dur
"""

# KEYS: pause_started, pause_history -> {paused_for_ms or -1, median recent duration ms or -1}
PAUSE_ESTIMATE = _NOW_MS + """
local started = redis.call('GET', KEYS[1])
local hist = redis.call('LRANGE', KEYS[2], 0, -1)
local med = -1
if #hist > 0 then
  local xs = {}
  for i, v in ipairs(hist) do xs[i] = tonumber(v) end
  table.sort(xs)
  med = xs[math.floor((#xs + 1) / 2)]
end
if not started then return {-1, med} end
return {now - tonumber(started), med}
"""


class AdmitStatus(IntEnum):
    """What the admission script answers (its Lua returns these numbers)."""

    ADMITTED = 1
    PAUSED = 0
    OVER_CAP = -1          # the rollout has gateway.max_concurrent_per_rollout calls live
    UNKNOWN_ROLLOUT = -2   # the statuses below only when a token was checked
    WRONG_TOKEN = -3
    ROLLOUT_CLOSED = -4

    @property
    def is_auth_failure(self) -> bool:
        return self < AdmitStatus.OVER_CAP


@dataclass
class DrainResult:
    seconds: float
    cancelled: int
    unended: int = 0    # cancelled requests still live when the wait for them ran out


class Admission:
    """The gateway's half, for one Redis. Cheap to build; scripts are registered once."""

    def __init__(self, client: redis.Redis, lease_ttl_s: float = 30.0,
                 max_per_rollout: int = 8) -> None:
        self.r = client
        self.ttl_ms = int(lease_ttl_s * 1000)
        self.max_per_rollout = max_per_rollout
        self._admit = client.register_script(ADMIT)
        self._record_release = client.register_script(RECORD_RELEASE)
        self._refresh = client.register_script(REFRESH)
        self._estimate = client.register_script(PAUSE_ESTIMATE)
        self._mark_lost = client.register_script(MARK_LOST_CAPTURES)
        # (wall time, rollout id, its calls after recording) of this process's recent
        # captures: after a Redis outage, those the crash lost are found here
        self._recent: deque[tuple[float, str, int]] = deque()

    def admit(self, rollout_id: str, token_sha256: str = "") -> tuple[AdmitStatus, str, int]:
        """-> (status, lease_id, policy_version); the statuses that judge the token only
        with ``token_sha256``."""
        return self.admit_call(rollout_id, token_sha256)[:3]

    def admit_call(self, rollout_id: str, token_sha256: str = ""
                   ) -> tuple[AdmitStatus, str, int, float | None]:
        """``admit``, and the temperature this rollout's calls are sampled at when it has
        one of its own (``RolloutRecord.temperature``: an evaluation's), else None."""
        lease_id = f"{rollout_id}|{uuid.uuid4().hex}"
        status, version, *rest = self._admit(
            keys=[keys.paused(), keys.leases(), keys.rollout_leases(rollout_id),
                  keys.policy_version(), keys.rollout(rollout_id)],
            args=[lease_id, self.ttl_ms, self.max_per_rollout, token_sha256])
        own = rest[0] if rest and rest[0] not in ("", "null") else None
        return (AdmitStatus(int(status)), lease_id, int(version),
                float(own) if own is not None else None)

    def record_and_release(self, lease_id: str, calls: list[str],
                           turn: tuple[str, str] | None = None) -> bool:
        """Append the captured calls (JSON) to the rollout and release the lease, atomically;
        False (nothing recorded) when a drain timeout cancelled the lease, or it expired.
        ``turn``: (digest, tag) of a one-call conversation kept for token continuity
        (``gateway/continuity.py``)."""
        rollout_id = lease_id.split("|", 1)[0]
        digest, tag = turn if turn is not None and len(calls) == 1 else ("", "")
        length = int(self._record_release(
            keys=[keys.leases(), keys.rollout_leases(rollout_id), keys.cancelled(),
                  keys.rollout_calls(rollout_id), keys.rollout_turns(rollout_id)],
            args=[lease_id, digest, tag, *calls]))
        if length and calls:
            now = time.time()
            self._recent.append((now, rollout_id, length))
            while self._recent and self._recent[0][0] < now - RECENT_CAPTURES_S:
                self._recent.popleft()
        return length > 0

    def check_lost_captures(self, began: float, ended: float) -> list[str]:
        """After a Redis outage (``began``/``ended``: wall times; equal for a restart no
        command waited through): the rollouts this process recorded calls for in the seconds
        before it that Redis no longer holds in full, each marked ``calls_lost`` (its
        agent saw a call that will not be trained, so the trainer leaves its sample out).
        Returns those marked now."""
        since = began - LOST_BEFORE_OUTAGE_S if ended > began else 0.0
        expected: dict[str, int] = {}
        for at, rollout_id, length in list(self._recent):
            if at >= since:
                expected[rollout_id] = max(expected.get(rollout_id, 0), length)
        return [rid for rid, length in expected.items()
                if self._mark_lost(keys=[keys.rollout(rid), keys.rollout_calls(rid)],
                                   args=[length])]

    def release(self, lease_id: str) -> None:
        """Give the lease back without recording anything (a refused or failed call)."""
        self.record_and_release(lease_id, [])

    def refresh(self, lease_ids: list[str]) -> int:
        if not lease_ids:
            return 0
        return int(self._refresh(
            keys=[keys.leases(), *(keys.rollout_leases(lid.split("|", 1)[0])
                                   for lid in lease_ids)],
            args=[self.ttl_ms, *lease_ids]))

    def cancelled_among(self, lease_ids: list[str]) -> set[str]:
        if not lease_ids:
            return set()
        flags = self.r.smismember(keys.cancelled(), lease_ids)
        return {lid for lid, flag in zip(lease_ids, flags, strict=True) if flag}

    def is_paused(self) -> bool:
        return bool(self.r.exists(keys.paused()))

    def retry_after_s(self, default_s: float) -> float:
        """Expected remaining pause: median of recent pauses minus time already paused."""
        paused_for, median = self._estimate(keys=[keys.pause_started(), keys.pause_history()])
        if int(median) < 0:
            return default_s
        remaining = (int(median) - max(int(paused_for), 0)) / 1000.0
        return max(remaining, 0.2)


class Pause:
    """The pausing half, for one Redis: the trainer around a weight load, or an operator
    through the gateway's admin routes. One object holds at most one pause at a time."""

    def __init__(self, client: redis.Redis, lease_ttl_s: float = 30.0) -> None:
        self.r = client
        self.ttl_ms = int(lease_ttl_s * 1000)
        self._pause = client.register_script(PAUSE)
        self._extend_pause = client.register_script(EXTEND_PAUSE)
        self._live = client.register_script(LIVE)
        self._resume = client.register_script(RESUME)
        self.pause_token = ""
        self._pause_ttl_ms = 0
        self.lost = False   # an extension of this object's pause failed: it may be gone

    def is_paused(self) -> bool:
        return bool(self.r.exists(keys.paused()))

    def pause(self, pause_ttl_s: float = 900.0) -> int:
        """Set the pause flag (expiring after ``pause_ttl_s`` unless resumed) and return the
        number of requests in flight at that moment. A short TTL kept alive with
        ``extend_pause`` makes the pause a lease of its holder."""
        self.pause_token = uuid.uuid4().hex
        self.lost = False
        self._pause_ttl_ms = int(pause_ttl_s * 1000)
        return int(self._pause(keys=[keys.paused(), keys.pause_started(), keys.leases()],
                               args=[self.pause_token, self._pause_ttl_ms]))

    def extend_pause(self, pause_ttl_s: float) -> bool:
        """Push the expiry of this object's pause ``pause_ttl_s`` ahead; False if the pause
        is gone or another holder took it over."""
        ok = bool(self._extend_pause(keys=[keys.paused(), keys.pause_started(),
                                           keys.pause_carries_on()],
                                     args=[self.pause_token, int(pause_ttl_s * 1000)]))
        if not ok:
            self.lost = True
        return ok

    def carry_on_cut_calls(self) -> None:
        """Tell the gateways that this pause's calls, ended in the engines, are to be carried
        on after it (``gateway.drain_mode: continue``) instead of ended for the agent."""
        self.r.set(keys.pause_carries_on(), self.pause_token, px=max(self._pause_ttl_ms, 1))

    def live_leases(self) -> int:
        return int(self._live(keys=[keys.leases()]))

    def drain(self, timeout_s: float, poll_s: float = 0.01,
              cancel_wait_s: float | None = None) -> DrainResult:
        """Wait until no lease is live. Past ``timeout_s`` the remaining requests are marked
        cancelled (their gateways abort them: the callers get a retryable error and nothing
        is captured), and the drain waits, at most ``cancel_wait_s`` (default: one lease TTL),
        until those requests have really ended, so nothing generates when it returns."""
        start = time.monotonic()
        deadline = start + timeout_s
        while self.live_leases() > 0:
            if time.monotonic() >= deadline:
                remaining = self.cancel_live()
                unended = self.wait_ended(remaining, self.ttl_ms / 1000.0
                                          if cancel_wait_s is None else cancel_wait_s, poll_s)
                return DrainResult(time.monotonic() - start, len(remaining), unended)
            time.sleep(poll_s)
        return DrainResult(time.monotonic() - start, 0)

    def cancel_live(self) -> list[str]:
        """Mark every live lease cancelled: its gateway aborts the upstream call, the caller
        gets a retryable error and nothing of the call is recorded. -> the lease ids."""
        self.live_leases()  # drops expired leases
        remaining = self.r.zrange(keys.leases(), 0, -1)
        if remaining:
            self.r.sadd(keys.cancelled(), *remaining)
            self.r.expire(keys.cancelled(), int(self.ttl_ms / 1000) + 60)
        return remaining

    def wait_ended(self, lease_ids: list[str], wait_s: float, poll_s: float = 0.01) -> int:
        """Wait until none of ``lease_ids`` is live (released, or expired); -> how many
        still were when ``wait_s`` ran out."""
        end = time.monotonic() + wait_s
        while lease_ids:
            self._live(keys=[keys.leases()])  # drops expired leases
            scores = self.r.zmscore(keys.leases(), lease_ids)
            lease_ids = [lid for lid, sc in zip(lease_ids, scores, strict=True)
                         if sc is not None]
            if not lease_ids or time.monotonic() >= end:
                break
            time.sleep(poll_s)
        return len(lease_ids)

    def holds_pause(self) -> bool:
        """Whether the pause flag is still this object's (it was not lost or taken over)."""
        return (bool(self.pause_token) and not self.lost
                and self.r.get(keys.paused()) == self.pause_token)

    def resume(self, keep_history: int = 20) -> float:
        """Clear this object's pause; returns how long it lasted (seconds). A pause set by
        another holder since is left in place (returns 0). An object that never paused (the
        admin route) clears whatever pause there is."""
        ms = int(self._resume(keys=[keys.paused(), keys.pause_started(), keys.pause_history(),
                                    keys.pause_carries_on()],
                              args=[keep_history, self.pause_token, max(self.ttl_ms, 1)]))
        return max(ms, 0) / 1000.0

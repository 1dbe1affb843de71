"""The policy version: its one read (``current_version``), and its repair after a Redis outage.

The trainer bumps ``keys.policy_version`` right after loading new weights into the inference
servers; the gateway labels every call it captures with it. A crash that loses the bump (the
last second of writes under ``appendfsync everysec``) would bring back the old number while
the servers hold the new weights: calls would be labelled with a version that did not serve
them, and the next update would reuse the number for other weights. The trainer worker
remembers the last version it published (``published_here``, set at the bump itself: a step
that then fails storing its result, or a run's start, counts too) and the record of the last
one it verified (``policy_published``, which the upstream keeper loads into a restarted
server) and, when Redis answers again after an outage, puts them back if Redis holds less
(never lowering them: another trainer may have gone further).
"""

from __future__ import annotations

import logging
import threading

import redis

from app.state import keys

log = logging.getLogger(__name__)

def current_version(client: redis.Redis) -> int:
    """The policy version Redis holds now (0 before the first weight load). Every plain read
    goes through here; the gateway's per-call read is cached
    (``cached_reads.policy_version``), and the pause script reads it inside Lua."""
    return int(client.get(keys.policy_version()) or 0)


# KEYS: policy_version; ARGV: version. Raises the version to ARGV, never lowers it.
_RAISE = """
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return now
end
return -1
"""


def restore_version(client: redis.Redis, version: int) -> int | None:
    """Raise the policy version to ``version`` if Redis holds less; returns the version it
    held before (None if it was not lower)."""
    before = int(client.eval(_RAISE, 1, keys.policy_version(), int(version)))
    return None if before < 0 else before


# KEYS: policy_published; ARGV: version, then field, value pairs. Writes the record when
# Redis holds none or an older one.
_RAISE_PUBLISHED = """
local now = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if now < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
  return 1
end
return 0
"""


class PublishedVersion:
    """The last version this process published, and the last it verified (the record the
    upstream keeper loads into a restarted server), put back after each Redis outage."""

    def __init__(self) -> None:
        self.version = 0
        self.record: dict[str, str] = {}
        self._lock = threading.Lock()

    def verified(self, record: dict[str, str]) -> None:
        with self._lock:
            self.record = dict(record)

    def published(self, version: int) -> None:
        # the latest, not the highest: after a Redis emptied on purpose (a new store) the
        # numbers start again, and the old run's are not this store's to restore
        with self._lock:
            self.version = int(version)

    def check(self, client: redis.Redis) -> int | None:
        """Put back what Redis lost; -> the version Redis held before, if it was lower."""
        with self._lock:
            version, record = self.version, dict(self.record)
        if record and int(client.eval(
                _RAISE_PUBLISHED, 1, keys.policy_published(), record["version"],
                *[x for kv in record.items() for x in kv])):
            log.warning("published policy version %s restored after a Redis outage (the "
                        "crash lost its record)", record["version"])
        if version <= 0:
            return None
        before = restore_version(client, version)
        if before is not None:
            log.warning("policy version %d restored after a Redis outage (Redis held %d: "
                        "the bump was among the writes the crash lost)", version, before)
        return before

    def check_soon(self, client: redis.Redis) -> None:
        """From an outage listener: in a thread of its own, since the listener runs inside
        the command (or the connect) that found Redis back, and may hold its only
        connection."""
        def run() -> None:
            try:
                self.check(client)
            except Exception as exc:  # noqa: BLE001 - the next outage or step checks again
                log.warning("could not check the policy version after an outage: %s", exc)

        threading.Thread(target=run, name="policy-version-check", daemon=True).start()


# The last version this process bumped the policy to and the last it verified (a trainer
# worker's; nothing elsewhere).
published_here = PublishedVersion()

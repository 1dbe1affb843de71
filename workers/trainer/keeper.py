"""The upstream keeper: puts the current weights back into an inference server that restarted.

A restarted vLLM server serves the initial model, not the policy the run has reached. The
keeper runs as a thread in the trainer worker: every ``trainer.upstream_check_s`` it checks
each server's ``/health``; a server that fails is added to ``upstreams_stale`` (the gateway
routes around it and agents get retryable 503s if none is left); once a stale server answers
again, the keeper loads the last published weights into it, proves them with the probe, and
only then removes it from the set. It shares a lock with the trainer's own publish, so a
reload never interleaves with a weight update.

Each load also records its policy version inside the server (vLLM's
``/update_weight_version``), and the keeper reads it back (``/weight_info``): a server that
restarted without the keeper seeing it down (behind a load balancer that answered for it)
says "default" again, and is reloaded like any stale one. The keeper also takes back an
engine left paused (or, where the engines sleep around updates, asleep) with no pause held:
a trainer that died between pausing it and resuming it skipped its own ``finally``.

Where the published weights cannot be loaded from here (they went by weight transfer and
this process holds no trainer, as after a restart of the trainer's host; or their export is
gone) the keeper says so in ``keys.upstreams_need_weights``: with every server stale no
rollout finishes and no update comes to reload them, so the driver asks the trainer worker
to load the run's weights and serve them (``restore_servers``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import redis
import requests

from app.state import keys
from app.state.pause import Pause
from app.state.policy import current_version
from workers.trainer import weights
from workers.trainer.weight_sync import NeedsTrainer, Sender, weight_sync_of

log = logging.getLogger(__name__)

# Held by a step from pause to resume and by the keeper while it reloads one server.
publish_lock = threading.Lock()


def left_held(client: redis.Redis, url: str, sleep_check: bool) -> list[str]:
    """What ``url``'s engine was left in by a dead trainer (``["paused"]``, and
    ``"sleeping"`` with ``sleep_check``): the state, with no pause held once it was read (a
    step pauses the gateway before the engines and resumes it after them, so a state read
    within a live pause is that step's)."""
    changes = [weights.PAUSE, *([weights.SLEEP] if sleep_check else [])]

    def held() -> list[str]:
        return [c.state_key.removeprefix("is_") for c in changes if weights.in_state(url, c)]

    # read twice: a step that ended between the first reads resumed the engine before its
    # pause ended, so the second read of the engine finds it running (only two whole steps
    # in between could fool both)
    for _ in range(2):
        left = held()
        if not left or Pause(client).is_paused():
            return []
    return left


@dataclass
class _Seen:
    """What one pass of the keeper read from Redis before looking at the servers."""

    stale: set[str]                 # servers marked stale (the pass adds to it)
    published: dict[str, str]       # the published record (re-read after a left-held one)
    version: int | None             # its version, when it is this model's
    owned: bool                     # a step holds the pause: it loads the servers itself
    current: int                    # the policy version
    unverified: bool                # current was bumped past the published version


class UpstreamKeeper:
    def __init__(self, client: redis.Redis, urls: list[str], model_name: str,
                 tolerance: float, every_s: float = 1.0, reload_timeout_s: float = 600.0,
                 dp_size: int = 1, sleep_check: bool = False) -> None:
        self.client = client
        self.every_s = every_s
        # sends the trainer's weights to one server where the published record is not
        # enough (weight transfer); set by the run's way while this process holds its trainer
        self.send_weights: Sender | None = None
        self._waiting: set[str] = set()   # stale, waiting for an unverified version's step
        self._failing: set[str] = set()   # stale, their restore failed (said once each)
        self._misses: dict[str, int] = {}  # looks in a row a server missed (health())
        self.configure(urls, model_name, tolerance, reload_timeout_s, dp_size, sleep_check)

    def configure(self, urls: list[str], model_name: str, tolerance: float,
                  reload_timeout_s: float = 600.0, dp_size: int = 1,
                  sleep_check: bool = False, every_s: float | None = None) -> None:
        """Follow the running run's config (it may name other servers than the worker's,
        and check them at another interval, ``trainer.upstream_check_s``)."""
        if every_s is not None:
            self.every_s = every_s
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name = model_name
        self.tolerance = tolerance
        self.reload_timeout_s = reload_timeout_s
        self.dp_size = dp_size
        self.sleep_check = sleep_check

    def start(self) -> None:
        # A daemon for the life of the trainer worker process.
        threading.Thread(target=self._run, name="upstream-keeper", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the keeper must outlive any one failure
                log.warning("upstream keeper: %s: %s", exc.__class__.__name__, exc)

    # misses in a row before a server that only answers slowly counts as down (a busy
    # engine may be slow once; the gateway waits for two misses too); a refused
    # connection counts at once
    MISSES_DOWN = 2

    @staticmethod
    def look(url: str) -> str:
        """``ok``, ``refused`` (nothing listens: down for sure) or ``miss`` (slow, an error
        status). With the servers' key, which a proxy in front may ask on every route."""
        try:
            resp = weights._http.get(url + "/health", timeout=5)
        except requests.RequestException as exc:
            return "refused" if weights.refused(exc) else "miss"
        return "ok" if resp.status_code == 200 else "miss"

    def health(self, url: str) -> str:
        """``ok``; ``down`` (refused, or the ``MISSES_DOWN``th miss in a row); or ``unsure``
        (a first miss: nothing is done with the server this pass)."""
        seen = self.look(url)
        if seen == "ok":
            self._misses.pop(url, None)
            return "ok"
        self._misses[url] = self._misses.get(url, 0) + 1
        return "down" if seen == "refused" or self._misses[url] >= self.MISSES_DOWN \
            else "unsure"

    def tick(self) -> list[str]:
        """One pass; returns the servers it restored. Skipped while this process's step
        holds the servers (pause to resume) or any pause is held: the step owns them."""
        if not publish_lock.acquire(blocking=False):
            return []
        try:
            return self._tick()
        finally:
            publish_lock.release()

    def _tick(self) -> list[str]:
        """One pass over the servers: mark what is down, behind or left held as stale, and
        restore the stale ones (not while a step holds the pause: it loads them itself)."""
        seen = self._look()
        restored = []
        for url in list(self.urls):
            if self._marked(url, seen) and self._restored(url, seen):
                restored.append(url)
        return restored

    def _look(self) -> _Seen:
        stale = self.client.smembers(keys.upstreams_stale())
        published = self.client.hgetall(keys.policy_published())
        version = int(published["version"]) if published and \
            published.get("model") == self.model_name else None
        # a version bumped past the published one: a step loaded it and died (or its probe
        # failed) before verifying it. Restoring the published weights would serve them
        # under the newer label: the servers wait, stale, for the next step's load
        current = current_version(self.client)
        unverified = current > version if version is not None \
            else not published and current > 0
        if not unverified:
            self._waiting.clear()
        self._failing &= stale  # restored meanwhile (by a step's load): said again if it recurs
        return _Seen(stale, published, version, Pause(self.client).is_paused(), current,
                     unverified)

    def _marked(self, url: str, seen: _Seen) -> bool:
        """Whether ``url`` is up and may be restored now; marks it stale when it is down,
        holds weights behind the published version, or was left paused or asleep."""
        health = self.health(url)
        if health == "unsure":
            return False  # looked at again next pass, not waited on now
        if health == "down":
            if url not in seen.stale:
                self.client.sadd(keys.upstreams_stale(), url)
                log.warning("inference server %s is down; rollouts are routed around it "
                            "until it is back and holds the current weights", url)
            return False
        if seen.owned:
            return False
        if url not in seen.stale and seen.version is not None:
            held = weights.loaded_version(url)
            if weights.behind(held, seen.version):
                log.warning("inference server %s holds weights %r, not policy version %d "
                            "(it restarted unseen, as behind a load balancer, or missed "
                            "a load): reloading it", url, held, seen.version)
                self.client.sadd(keys.upstreams_stale(), url)
                seen.stale.add(url)
        left = left_held(self.client, url, self.sleep_check) if url not in seen.stale else []
        if left:
            # a trainer died between pausing (or putting to sleep) the engine and taking it
            # back: it may have been mid-load, and asleep the engine may have dropped its
            # weights (level 2), so it is reloaded, not only resumed
            log.warning("inference server %s is %s with no pause held (a trainer died "
                        "mid-update): reloading and resuming it", url, " and ".join(left))
            self.client.sadd(keys.upstreams_stale(), url)
            seen.stale.add(url)
            # what a step of another process published meanwhile
            seen.published = self.client.hgetall(keys.policy_published())
        return True

    def _restored(self, url: str, seen: _Seen) -> bool:
        """Restore a stale ``url`` to the published weights; whether it was."""
        if url not in seen.stale:
            return False
        if seen.unverified:
            if url not in self._waiting:
                self._waiting.add(url)
                log.warning("inference server %s stays stale: policy version %d was loaded "
                            "but never verified (its step failed), and the last verified "
                            "one is %s; the next update loads it", url, seen.current,
                            seen.version)
            return False
        # one server's failure must not keep the keeper from the others
        try:
            self.restore(url, seen.published)
        except NeedsTrainer as exc:
            self._ask_for_weights(url, str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - said, retried at the next tick
            self._failed(url, f"{exc.__class__.__name__}: {exc}")
            return False
        self._waiting.discard(url)
        self._failing.discard(url)
        return True

    def _failed(self, url: str, why: str) -> None:
        if url not in self._failing:
            self._failing.add(url)
            log.warning("inference server %s is back but could not be restored (retried "
                        "every %.0f s): %s", url, self.every_s, why)

    def _ask_for_weights(self, url: str, why: str) -> None:
        """Until a verified publish: a restore that fails is asked for again."""
        self.client.set(keys.upstreams_need_weights(), f"{url}: {why}")
        self._failed(url, why + "; the driver asks the trainer worker for the run's weights")

    def _no_step_began(self, url: str) -> None:
        """Raise if a step (of another trainer process) took the pause while this restore
        ran: the engines are its own now, not to be resumed or declared restored."""
        if Pause(self.client).is_paused():
            raise weights.WeightSyncError(
                f"{url}: a step began while the keeper restored it; left to that step's load")

    def restore(self, url: str, published: dict[str, str]) -> None:
        """Put the last published weights into ``url`` (called with ``publish_lock``
        held): woken if asleep, loaded, resumed if a failed step left it paused, then
        proved by the probe; only then is it taken out of the stale set."""
        if published and published.get("model") != self.model_name:
            # another model's weights (a run of another config on this Redis): they
            # cannot load into this server; the next run's start publishes its own
            log.warning("inference server %s is back; the last published weights are of "
                        "model %r, not %r (%s): not loaded, it serves its initial model",
                        url, published.get("model"), self.model_name, published["path"])
            weights.wake_if_asleep(url, self.reload_timeout_s)
            self._no_step_began(url)
            weights.resume_if_paused(url)
            self.client.srem(keys.upstreams_stale(), url)
            return
        if published:
            weights.wake_if_asleep(url, self.reload_timeout_s)
            # calls frozen in an engine a failed step left paused: their KV goes with the
            # old weights, so they recompute it on the new ones
            frozen = weights.in_state(url, weights.PAUSE)
            way = weight_sync_of(published)
            way.reload(url, published, self.reload_timeout_s, frozen, self.send_weights)
            self._no_step_began(url)
            weights.resume_if_paused(url)
            weights.verify_sync(url, way.served_in(published, self.model_name),
                                json.loads(published["probe"]),
                                None, self.tolerance,
                                json.loads(published.get("probe_ids", "null")), self.dp_size)
        else:
            weights.wake_if_asleep(url, self.reload_timeout_s)
            self._no_step_began(url)
            weights.resume_if_paused(url)
        self._no_step_began(url)
        self.client.srem(keys.upstreams_stale(), url)
        if published:
            log.warning("inference server %s is back: loaded and verified policy version %s "
                        "(%s)", url, published["version"],
                        weight_sync_of(published).source(published))
        else:
            log.warning("inference server %s is back (no weights published yet: it serves the "
                        "initial model, as it should)", url)


_keeper: UpstreamKeeper | None = None


def running_keeper() -> UpstreamKeeper | None:
    return _keeper


def start_keeper(client: redis.Redis, urls: list[str], model_name: str, tolerance: float,
                 every_s: float) -> UpstreamKeeper:
    global _keeper
    if _keeper is None:
        _keeper = UpstreamKeeper(client, urls, model_name, tolerance, every_s)
        _keeper.start()
        log.info("upstream keeper watching %s every %.1f s", ", ".join(_keeper.urls), every_s)
    return _keeper

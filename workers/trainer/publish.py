"""Publishing the trainer's weights: load them into every inference server that answers,
bump the policy version, prove them with the probe, record them as published.

The way they travel (an export each server reloads, a LoRA adapter, a weight transfer) is
the run's ``weight_sync`` way (``workers/trainer/weight_sync/``); this module does what is
the same for every way: the partial failures. A server that is down is marked stale and
loaded by the upstream keeper when it is back; one whose load failed may hold part of the
version, so it is marked stale too and neither resumed nor left asleep; with no server
reachable the publish waits (the gateway stays paused) for ``trainer.reload_timeout_s``.
Only a version every loaded server scores as the trainer does is recorded as published
(``keys.policy_published``), the record the keeper restores a restarted server from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from app.state import keys
from app.state.cached_reads import POLICY_VERSION_MAX_AGE_S
from app.state.policy import current_version, published_here
from workers.trainer import weights
from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync import Loader, WeightSync, weight_sync_for
from workers.trainer.weight_sync.base import Metrics
from workers.trainer.weight_sync.disk import disk_loader

if TYPE_CHECKING:
    from workers.trainer.resident import Resident

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    version: int
    path: Path | None   # the export (None: sent by weight transfer)
    loaded: list[str]   # the servers that hold it
    way: WeightSync     # how it went: what its verification checks and records


def publish(client: redis.Redis, settings: TrainerSettings, resident: Resident,
            timings: dict[str, float], metrics: Metrics,
            asleep: weights.Held = weights.NOTHING_HELD,
            held: weights.Held = weights.NOTHING_HELD, fresh_base: bool = False) -> Published:
    """Save the trainer's weights as the next version, load them into every reachable
    server, bump the policy version and resume the engines in ``held``.

    Engines in ``asleep`` (a collocated update) get their memory back in the order of verl's
    colocated weight update: the export (the engines still asleep), the trainer empties its
    allocator's cache, each engine wakes its weights only, the load, the trainer parks what
    ``fsdp_config`` offloads and empties the cache again on every rank (the call returns when
    all have: a barrier), and only then the engines wake their KV cache. Each rank's memory
    at each of these points is a metric (``memory/trainer_rank<r>_<stage>_*``)."""
    sync = weight_sync_for(settings)
    trainer = resident.trainer
    if asleep.urls:
        metrics.update(trainer.memory("after_update"))
    version = current_version(client) + 1
    path, load = sync.prepare(resident, version, held.frozen_calls, metrics, timings,
                              client.hget(keys.policy_published(), "path") or None,
                              fresh_base)

    t = time.monotonic()
    if asleep.urls:
        metrics.update(trainer.release_memory("before_weights_wake", offload=False))
        asleep.wake(["weights"])

    def wake_kv_cache() -> None:
        if asleep.urls:
            metrics.update(trainer.release_memory("before_kv_cache_wake", offload=True))
            asleep.release(tags=["kv_cache"])

    loaded = switch_weights(client, list(settings.inference.urls), path, version, held,
                            settings.reload_timeout_s, settings.upstream_check_s, asleep,
                            wake_kv_cache, load)
    timings[sync.timing] = time.monotonic() - t
    resident.weights_version = version
    return Published(version, path, loaded, sync)


def verify(client: redis.Redis, settings: TrainerSettings, resident: Resident,
           published: Published, previous: list[float] | None, metrics: Metrics,
           timings: dict[str, float]) -> None:
    """Prove the load with the probe: every loaded server scores the probe as the trainer
    does (and, given the ``previous`` probe, closer to the new weights than to the old);
    only then is the version recorded as published, which the upstream keeper loads into
    a server that restarts.

    A probe that fails leaves the version bumped: the servers do hold that version's
    weights, only not verified ones, and the step fails."""
    sync = published.way
    t = time.monotonic()
    ids = resident.probe_ids
    expected = resident.trainer.probe_log_probs(ids)
    moved = previous is not None and weights.mean_gap(expected, previous) > \
        settings.probe_tolerance
    served = sync.served_name(published.version)
    for url in published.loaded:
        metrics.update(weights.verify_sync(url, served,
                                           expected, previous, settings.probe_tolerance, ids,
                                           settings.inference.data_parallel_size))
        sync.check_loaded(url, resident, moved, metrics)
    client.srem(keys.upstreams_stale(), *[u.rstrip("/") for u in published.loaded])
    # the keeper can load these into a restarted server itself (keys.upstreams_need_weights)
    client.delete(keys.upstreams_need_weights())
    resident.probe_prev = expected
    resident.published = True
    timings["probe"] = time.monotonic() - t
    record = {
        "version": str(published.version),
        **sync.record(published.path, published.version),
        "model": settings.inference.served_model_name,
        "probe": json.dumps(expected), "probe_ids": json.dumps(ids)}
    client.hset(keys.policy_published(), mapping=record)
    published_here.verified(record)  # put back if a Redis crash loses this write
    sync.verified(published.path)


def switch_weights(client: redis.Redis, urls: list[str], path: Path | None, version: int,
                   held: weights.Held, wait_s: float, every_s: float,
                   asleep: weights.Held = weights.NOTHING_HELD,
                   wake: Callable[[], None] = lambda: None,
                   load: Loader | None = None) -> list[str]:
    """Load the version (the export at ``path``, or through ``load``) into every reachable
    server, make ``version`` the policy version, run ``wake`` (a collocated step wakes the
    KV caches there), then resume the engines in ``held`` (checked). Returns the servers
    loaded.

    The version is set while the engines are still paused (or asleep), and they run again
    twice ``POLICY_VERSION_MAX_AGE_S`` later: every gateway process then reads the new
    version by the first token a frozen call samples on the new weights, and places the
    switch there. That holds for the wake too: vLLM resumes an engine's scheduler once it
    is fully awake. An engine loaded here that this step did not pause but reports paused
    was left so by a dead trainer: it is resumed with the others (paused, it would fail the
    probe)."""
    if load is None:
        assert path is not None
        load = disk_loader(path, version, wait_s, held.frozen_calls)
    loaded = _reload_reachable(client, urls, load, version, wait_s, every_s, held, asleep)
    client.set(keys.policy_version(), version)
    published_here.published(version)  # put back if a Redis crash loses this write
    # (an engine asleep reports paused until it wakes whole)
    left = [u.rstrip("/") for u in loaded if u.rstrip("/") not in held.urls
            and u.rstrip("/") not in asleep.urls and weights.in_state(u, weights.PAUSE)]
    if left:
        log.warning("%s: left paused by a dead trainer; resumed on version %d",
                    ", ".join(left), version)
    if held.urls or left or asleep.urls:
        time.sleep(2 * POLICY_VERSION_MAX_AGE_S)
    wake()
    if held.urls or left:
        orphans = weights.Held(weights.PAUSE, left)
        try:
            held.release()
        finally:
            orphans.release()
    return loaded


def _reload_reachable(client: redis.Redis, urls: list[str], load: Loader, version: int,
                      wait_s: float, every_s: float, held: weights.Held,
                      asleep: weights.Held = weights.NOTHING_HELD) -> list[str]:
    """Load the version into every server that answers; returns those. A server that is
    down is marked stale (the upstream keeper loads it when it is back, the gateway routes
    around it meanwhile). With none reachable, keep trying for ``wait_s`` (the gateway stays
    paused: a restarted server must hold the current weights before agents reach it).

    A load that fails or outlasts ``wait_s`` (``trainer.reload_timeout_s``) may have left
    part of the new weights in the engine: that server is marked stale too, and is left
    out of ``held``, so it is not resumed on them, and out of ``asleep`` (woken now,
    unchecked: never left asleep; the keeper restores it). A server unreachable at the end
    is left out of both (nothing to resume or wake; it comes back fresh).
    ``held.frozen_calls``: requests wait frozen in the engines (their KV is dropped too)."""
    deadline = time.monotonic() + wait_s
    errors: dict[str, str] = {}
    failed: dict[str, str] = {}
    while True:
        out = load([u for u in urls if u not in failed])
        for url, why in out.unreachable.items():
            client.sadd(keys.upstreams_stale(), url.rstrip("/"))
            if url not in errors:
                log.warning("inference server %s is unreachable; it gets version %d when "
                            "it is back", url, version)
            errors[url] = why
        for url, why in out.failed.items():
            client.sadd(keys.upstreams_stale(), url.rstrip("/"))
            held.forget(url)
            if url.rstrip("/") in asleep.urls:
                asleep.forget(url)
                weights.wake_engines([url], asleep.timeout, check=False)
            failed[url] = why
            log.error("inference server %s did not load version %d: %s; it is not "
                      "resumed, and serves nobody until the upstream keeper has loaded "
                      "the current weights into it", url, version, why)
        loaded = out.loaded
        if loaded:
            for url in errors:  # still unreachable: it restarts fresh, nothing to undo
                if url not in loaded:
                    held.forget(url)
                    asleep.forget(url)
            return loaded
        if len(failed) == len(urls):
            raise weights.WeightSyncError(
                f"no inference server loaded version {version}: "
                + "; ".join(f"{u} ({e})" for u, e in {**errors, **failed}.items()))
        if time.monotonic() >= deadline:
            raise weights.WeightSyncError(
                f"no inference server could be reached to load version {version} within "
                f"{wait_s:.0f} s (Connection refused or lost): "
                + "; ".join(f"{u} ({e})" for u, e in {**errors, **failed}.items()))
        time.sleep(every_s)

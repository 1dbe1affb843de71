"""The upstream keeper: puts the current weights back into an inference server that restarted.

A restarted vLLM server serves the initial model, not the policy the run has reached. The
keeper runs as a thread in the trainer worker: every ``trainer.upstream_check_s`` it checks
each server's ``/health``; a server that fails is added to ``upstreams_stale`` (the gateway
routes around it and agents get retryable 503s if none is left); once a stale server answers
again, the keeper loads the last published weights into it, proves them with the probe, and
only then removes it from the set. It shares a lock with the trainer's own publish, so a
reload never interleaves with a weight update.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import redis
import requests

from app.state import keys
from workers.trainer import weights

log = logging.getLogger(__name__)

# Held by a step from pause to resume and by the keeper while it reloads one server.
publish_lock = threading.Lock()


class UpstreamKeeper:
    def __init__(self, client: redis.Redis, urls: list[str], model_name: str,
                 tolerance: float, every_s: float = 1.0) -> None:
        self.client = client
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name = model_name
        self.tolerance = tolerance
        self.every_s = every_s

    def configure(self, urls: list[str], model_name: str, tolerance: float) -> None:
        """Follow the running run's config (it may name other servers than the worker's)."""
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name = model_name
        self.tolerance = tolerance

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

    @staticmethod
    def healthy(url: str) -> bool:
        try:
            return requests.get(url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def tick(self) -> list[str]:
        """One pass; returns the servers it restored."""
        stale = self.client.smembers(keys.upstreams_stale())
        restored = []
        for url in list(self.urls):
            if not self.healthy(url):
                if url not in stale:
                    self.client.sadd(keys.upstreams_stale(), url)
                    log.warning("inference server %s is down; rollouts are routed around it "
                                "until it is back and holds the current weights", url)
            elif url in stale:
                self.restore(url)
                restored.append(url)
        return restored

    def restore(self, url: str) -> None:
        with publish_lock:
            if not self.client.sismember(keys.upstreams_stale(), url):
                return  # a step's publish reached it first
            published = self.client.hgetall(keys.policy_published())
            if published and published.get("model") != self.model_name:
                # another model's weights (a run of another config on this Redis): they
                # cannot load into this server; the next run's start publishes its own
                log.warning("inference server %s is back; the last published weights are of "
                            "model %r, not %r (%s): not loaded, it serves its initial model",
                            url, published.get("model"), self.model_name, published["path"])
                self.client.srem(keys.upstreams_stale(), url)
                return
            if published:
                weights.reload_weights(url, Path(published["path"]))
                weights.verify_sync(url, self.model_name, json.loads(published["probe"]),
                                    None, self.tolerance,
                                    json.loads(published.get("probe_ids", "null")))
            self.client.srem(keys.upstreams_stale(), url)
        if published:
            log.warning("inference server %s is back: loaded and verified policy version %s "
                        "(%s)", url, published["version"], published["path"])
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

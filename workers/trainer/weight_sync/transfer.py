"""``inference.weight_sync: transfer``: the trainer sends its weights to the servers through
vLLM's weight-transfer routes (``workers/trainer/transfer.py``), no export. Nothing on disk
holds the published version, so only a trainer holding it can load a restarted server: the
keeper asks this process's trainer (``send_again``) or, with none, the driver
(``NeedsTrainer``). With ``inference.transfer_checksums`` each load is also checked tensor
by tensor."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from workers.trainer import weights
from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync.base import (
    Loader,
    LoadOutcome,
    Metrics,
    NeedsTrainer,
    Sender,
    WeightSync,
    dtype_name,
)

if TYPE_CHECKING:
    from workers.trainer.resident import Resident


def transfer_loader(resident: Resident, settings: TrainerSettings, version: int,
                    frozen_calls: bool, metrics: Metrics) -> Loader:
    """The trainer sends its weights to the servers, then each resets its prefix cache."""
    inf = settings.inference
    dtype = dtype_name(settings)

    def load(urls: list[str]) -> LoadOutcome:
        # a server that refuses connections now is not worth a gather of the whole model
        # (a step waiting for one to come back would redo it every upstream_check_s)
        down = {u: "ConnectionError: /health refused" for u in urls if not _answers(u)}
        urls = [u for u in urls if u not in down]
        if not urls:
            return LoadOutcome(unreachable=down)
        try:
            sent = resident.trainer.transfer_weights(
                urls, dtype, inf.transfer_bucket_bytes, settings.reload_timeout_s,
                weights.api_key(), inf.transfer_engine)
        except Exception as exc:  # noqa: BLE001 - an error on the trainer's side, mid-way
            # any server may hold part of the version: each is failed (stale, not resumed)
            why = f"the transfer failed on the trainer: {exc.__class__.__name__}: {exc}"
            return LoadOutcome(failed={u: why for u in urls})
        metrics["weight_sync/bytes_moved"] = sent.bytes_moved
        metrics["weight_sync/buckets"] = sent.buckets
        out = LoadOutcome(unreachable={**down, **sent.unreachable}, failed=dict(sent.failed))
        for url in sent.loaded:
            try:
                weights.after_load(url, settings.reload_timeout_s, frozen_calls, version)
                out.loaded.append(url)
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
        return out
    return load


def _answers(url: str) -> bool:
    """The server takes connections (any answer, even an error, says it is up)."""
    try:
        requests.get(url.rstrip("/") + "/health", timeout=5)
        return True
    except requests.ConnectionError:
        return False
    except requests.RequestException:
        return True


def send_again(resident: Resident, settings: TrainerSettings, url: str, version: int,
               frozen_calls: bool) -> None:
    """The upstream keeper's load of a restarted server: the trainer's weights, only while
    they are still ``version`` (between an update and its publish they are not, and the
    step's own load reaches that server)."""
    busy = weights.WeightSyncError(
        f"{url}: the trainer's weights are not policy version {version} now (an update or "
        "a checkpoint is under way); the step's own load reaches this server")
    lock = resident.trainer.ranks.lock
    # not waiting: the keeper holds the publish lock, and an update can take minutes
    if not lock.acquire(blocking=False):
        raise busy
    try:  # no update starts meanwhile
        if resident.weights_version != version:
            raise busy
        out = transfer_loader(resident, settings, version, frozen_calls, {})([url])
    finally:
        lock.release()
    if url not in out.loaded:
        why = {**out.unreachable, **out.failed}.get(url, "not loaded")
        raise weights.WeightSyncError(f"{url}: weight transfer of version {version}: {why}")


class TransferSync(WeightSync):
    name = "transfer"
    timing = "transfer"

    def prepare(self, resident: Resident, version: int, frozen_calls: bool,
                metrics: Metrics, timings: dict[str, float], published: str | None,
                fresh_base: bool = False) -> tuple[Path | None, Loader]:
        return None, transfer_loader(resident, self.settings, version, frozen_calls, metrics)

    def check_loaded(self, url: str, resident: Resident, moved: bool,
                     metrics: Metrics) -> None:
        if not self.settings.inference.transfer_checksums:
            return
        # the checksums cover every replica's every tensor (the probe: its output)
        digests = weights.weight_checksums(url, self.settings.reload_timeout_s)
        metrics.update(weights.check_checksums(url, digests, resident.digests.get(url), moved))
        resident.digests[url] = digests

    def record(self, path: Path | None, version: int) -> dict[str, str]:
        return {"path": "", "adapter": ""}

    def sender(self, resident: Resident) -> Sender | None:
        return partial(send_again, resident, self.settings)

    @classmethod
    def reload(cls, url: str, published: Mapping[str, str], timeout: float,
               frozen_calls: bool, send: Sender | None) -> None:
        if send is None:
            raise NeedsTrainer(
                f"policy version {int(published['version'])} went to the servers by weight "
                "transfer and no trainer in this process can send it again (the trainer "
                "worker restarted)")
        send(url, int(published["version"]), frozen_calls)

    @classmethod
    def source(cls, published: Mapping[str, str]) -> str:
        return "by weight transfer"

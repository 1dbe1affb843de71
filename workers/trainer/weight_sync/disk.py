"""``inference.weight_sync: disk``: the trainer exports each version in the servers' dtype
(``weights_dir``, or ``/dev/shm`` where it fits and every server is local) and each server
reloads it from there. The export is the published version's source: the keeper reloads a
restarted server from it, and it is kept until a later version is verified."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from workers.trainer import weights
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
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.resident import Resident

log = logging.getLogger(__name__)


def disk_loader(path: Path, version: int, timeout: float, frozen_calls: bool) -> Loader:
    """Each server reloads the export at ``path``."""
    def load(urls: list[str]) -> LoadOutcome:
        out = LoadOutcome()
        for url in urls:
            try:
                weights.reload_weights(url, path, timeout=timeout, frozen_calls=frozen_calls,
                                       version=version)
                out.loaded.append(url)
            except requests.ConnectionError as exc:
                out.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
        return out
    return load


class DiskSync(WeightSync):
    name = "disk"
    timing = "reload"

    def prepare(self, resident: Resident, version: int, frozen_calls: bool,
                metrics: Metrics, timings: dict[str, float], published: str | None,
                fresh_base: bool = False) -> tuple[Path | None, Loader]:
        path = self.export(resident, version, timings, published)
        return path, disk_loader(path, version, self.settings.reload_timeout_s, frozen_calls)

    def export(self, resident: Resident, version: int, timings: dict[str, float],
               published: str | None = None) -> Path:
        """``version``'s export in the servers' dtype. The ``published`` export is kept
        whatever ``keep_weight_versions`` says until this one is verified."""
        settings = self.settings
        trainer = resident.trainer
        t = time.monotonic()
        dtype = dtype_name(settings)
        if resident.export_root is None:
            resident.export_root = self.export_root(trainer)
        path = weights.publish_version(resident.export_root, version,
                                       settings.keep_weight_versions,
                                       lambda tmp: self.write(trainer, tmp, dtype),
                                       Path(published) if published else None)
        timings["save"] = time.monotonic() - t
        return path

    def export_root(self, trainer: EngineTrainer) -> Path:
        """Where this process's exports go (decided once, at its first)."""
        settings = self.settings
        inf = settings.inference
        size = trainer.parameter_count() * weights.engine_dtype(
            inf.dtype, settings.model_path).itemsize
        # rank 0 writes the export: shared memory only where it runs on this host
        root = weights.export_root(
            settings.weights_dir, settings.weights_in_memory and trainer.exports_here,
            list(inf.urls), size, settings.keep_weight_versions)
        log.info("weight exports of %.2f GB go to %s", size / 1e9, root)
        return root

    def write(self, trainer: EngineTrainer, path: Path, dtype: str) -> None:
        """The whole model."""
        trainer.export_weights(path, dtype)

    def record(self, path: Path | None, version: int) -> dict[str, str]:
        assert path is not None  # prepare exported it
        return {"path": str(path.resolve()), "adapter": ""}

    def verified(self, path: Path | None) -> None:
        # the exports before it beyond those kept go
        assert path is not None
        weights.prune_versions(path.parent, self.settings.keep_weight_versions)

    @classmethod
    def reload(cls, url: str, published: Mapping[str, str], timeout: float,
               frozen_calls: bool, send: Sender | None) -> None:
        weights.reload_weights(url, cls.export_of(published), timeout,
                               frozen_calls=frozen_calls, version=int(published["version"]))

    @staticmethod
    def export_of(published: Mapping[str, str]) -> Path:
        """The published version's export, which must still be there."""
        path = Path(published["path"])
        if not path.is_dir():
            raise NeedsTrainer(f"the export of policy version {int(published['version'])} "
                               f"({path}) is gone (a reboot empties /dev/shm)")
        return path

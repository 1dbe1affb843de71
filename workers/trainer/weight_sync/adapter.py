"""LoRA (``actor_rollout_ref.model.lora_rank`` > 0): each version goes as its adapter alone
(megabytes, exported to ``weights_dir``: no shared memory needed), which every server
serves under its own name (``adapter_name``) over base weights that stay. By disk always:
the config refuses LoRA with ``weight_sync: transfer``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from app.config.settings import adapter_name
from workers.trainer import weights
from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync.base import Loader, LoadOutcome, Metrics, Sender, add_count
from workers.trainer.weight_sync.disk import DiskSync

if TYPE_CHECKING:
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.resident import Resident

log = logging.getLogger(__name__)


def adapter_loader(path: Path, settings: TrainerSettings, version: int, frozen_calls: bool,
                   metrics: Metrics, fresh_base: bool = False) -> Loader:
    """Each server serves ``version``'s adapter under its own name (the base weights
    stay), then stops serving the ones before the previous version: every call in flight
    was drained at this pause, and a call that outlived the drain (ended by the gateway,
    perhaps not yet by the engine) names at most the previous one. ``fresh_base``: first
    reload the base weights from the model (a run's start: a previous run may have left
    others there)."""
    inf = settings.inference
    name = adapter_name(inf.served_model_name, version)
    metrics.setdefault("weight_sync/unloaded_adapters", 0)
    keep = {name, adapter_name(inf.served_model_name, version - 1)}
    timeout = settings.reload_timeout_s

    def load(urls: list[str]) -> LoadOutcome:
        out = LoadOutcome()
        for url in urls:
            try:
                if fresh_base:  # a run's start: the base as the model has it
                    weights.reload_weights(url, settings.model_path, timeout)
                weights.load_adapter(url, name, path, timeout, frozen_calls, version)
                out.loaded.append(url)
            except requests.ConnectionError as exc:
                out.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            except (requests.RequestException, ValueError, weights.WeightSyncError) as exc:
                out.failed[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            try:  # the load stands whatever this does
                for old in weights.served_adapters(url, inf.served_model_name):
                    if old not in keep:
                        add_count(metrics, "weight_sync/unloaded_adapters",
                                  weights.unload_adapter(url, old, timeout))
            except requests.RequestException as exc:
                log.warning("%s: older adapters not unloaded (%s); the next load tries again",
                            url, exc)
        return out
    return load


class AdapterSync(DiskSync):
    name = "adapter"

    def prepare(self, resident: Resident, version: int, frozen_calls: bool,
                metrics: Metrics, timings: dict[str, float], published: str | None,
                fresh_base: bool = False) -> tuple[Path | None, Loader]:
        path = self.export(resident, version, timings, published)
        return path, adapter_loader(path, self.settings, version, frozen_calls, metrics,
                                    fresh_base)

    def export_root(self, trainer: EngineTrainer) -> Path:
        return self.settings.weights_dir

    def write(self, trainer: EngineTrainer, path: Path, dtype: str) -> None:
        """The adapter alone, in peft's format."""
        trainer.export_adapter(path, dtype)

    def served_name(self, version: int) -> str:
        return adapter_name(self.settings.inference.served_model_name, version)

    def record(self, path: Path | None, version: int) -> dict[str, str]:
        return {**super().record(path, version), "adapter": self.served_name(version)}

    @classmethod
    def reload(cls, url: str, published: Mapping[str, str], timeout: float,
               frozen_calls: bool, send: Sender | None) -> None:
        weights.load_adapter(url, published["adapter"], cls.export_of(published), timeout,
                             frozen_calls=frozen_calls, version=int(published["version"]))

    @classmethod
    def served_in(cls, published: Mapping[str, str], model_name: str) -> str:
        return published["adapter"]

"""How a version's weights get into the inference servers: one way per file, chosen once.

- ``disk`` (``disk.py``): the trainer exports the model, each server reloads the export.
- ``adapter`` (``adapter.py``): LoRA; the adapter alone is exported, each server serves it
  under the version's own name over the base weights.
- ``transfer`` (``transfer.py``): the trainer sends its weights through vLLM's
  weight-transfer routes, no export.

A step's publish takes the run's way from its config (``weight_sync_for``: the adapter
whenever the model trains one, else ``inference.weight_sync``). The upstream keeper, which
may hold no trainer and serve another run's record, takes the way that published the
record it reloads (``weight_sync_of``: each way's ``record`` fields tell it). These two
functions are the only places the mode is told apart; the rest asks the way.

A fourth way is one new file here, a ``WeightSync`` subclass (``base.py``: the loader of a
version and its export if any, the record it leaves, the keeper's reload of a restarted
server), and its entry in ``WAYS`` under the name ``inference.weight_sync`` gives it (the
names ``app.config.settings.WeightSync`` accepts). Should its record look like another
way's (no export path, or an adapter's name), ``weight_sync_of`` learns to tell it apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync.adapter import AdapterSync
from workers.trainer.weight_sync.base import (
    Loader,
    LoadOutcome,
    NeedsTrainer,
    Sender,
    WeightSync,
)
from workers.trainer.weight_sync.disk import DiskSync
from workers.trainer.weight_sync.transfer import TransferSync

__all__ = ["WAYS", "Loader", "LoadOutcome", "NeedsTrainer", "Sender", "WeightSync",
           "weight_sync_for", "weight_sync_of"]

WAYS: dict[str, type[WeightSync]] = {w.name: w for w in (DiskSync, AdapterSync, TransferSync)}


def weight_sync_for(settings: TrainerSettings) -> WeightSync:
    """The run's way (LoRA goes by disk: the config refuses it with transfer)."""
    inf = settings.inference
    return WAYS[AdapterSync.name if inf.lora else inf.weight_sync](settings)


def weight_sync_of(published: Mapping[str, str]) -> type[WeightSync]:
    """The way that left ``published`` (``keys.policy_published``): no export path is a
    transfer, an adapter's name an adapter, else the disk."""
    if not published.get("path"):
        return TransferSync
    return AdapterSync if published.get("adapter") else DiskSync

"""The weight-sync ways (``workers.trainer.weight_sync``): every mode the config accepts has
one, a run's config picks it, and a published record names the way the keeper reloads it by,
whatever config the keeper holds."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from app.config import load_config
from app.config.settings import WeightSync, adapter_name
from workers.trainer.settings import TrainerSettings
from workers.trainer.weight_sync import WAYS, NeedsTrainer, weight_sync_for, weight_sync_of
from workers.trainer.weight_sync.adapter import AdapterSync
from workers.trainer.weight_sync.disk import DiskSync
from workers.trainer.weight_sync.transfer import TransferSync


def _settings(weight_sync: WeightSync = "disk", lora: bool = False) -> TrainerSettings:
    settings = TrainerSettings.from_config(load_config(None, []))
    return replace(settings, inference=replace(settings.inference, weight_sync=weight_sync,
                                               lora=lora))


def test_every_mode_the_config_accepts_has_a_way():
    assert set(get_args(WeightSync)) <= set(WAYS)


@pytest.mark.parametrize(("weight_sync", "lora", "way"), [
    ("disk", False, DiskSync), ("transfer", False, TransferSync), ("disk", True, AdapterSync)])
def test_the_run_config_picks_the_way(weight_sync, lora, way):
    sync = weight_sync_for(_settings(weight_sync, lora))
    assert type(sync) is way
    # what the way records, the keeper reads back as the same way
    record = sync.record(None if way is TransferSync else _settings().weights_dir / "v3", 3)
    assert weight_sync_of({"version": "3", **record}) is way


def test_a_record_names_its_way_and_what_the_probe_asks():
    model = "policy"
    disk = {"version": "3", "path": "/w/v3", "adapter": ""}
    lora = {**disk, "adapter": adapter_name(model, 3)}
    sent = {"version": "3", "path": "", "adapter": ""}
    assert weight_sync_of(disk) is DiskSync and weight_sync_of(lora) is AdapterSync
    assert weight_sync_of(sent) is TransferSync
    # a record with no adapter field is the disk's
    assert weight_sync_of({"version": "3", "path": "/w/v3"}) is DiskSync
    assert weight_sync_of(disk).served_in(disk, model) == model
    assert weight_sync_of(lora).served_in(lora, model) == "policy-v3"
    assert weight_sync_of(sent).source(sent) == "by weight transfer"
    assert weight_sync_of(disk).source(disk) == "/w/v3"


def test_the_keeper_cannot_reload_what_only_a_trainer_or_a_gone_export_holds(tmp_path):
    sent = {"version": "4", "path": "", "adapter": ""}
    with pytest.raises(NeedsTrainer, match="no trainer in this process"):
        TransferSync.reload("http://127.0.0.1:1", sent, 1.0, False, None)
    calls: list[tuple[str, int, bool]] = []
    TransferSync.reload("http://s", sent, 1.0, True, lambda u, v, f: calls.append((u, v, f)))
    assert calls == [("http://s", 4, True)]
    gone = {"version": "4", "path": str(tmp_path / "v4"), "adapter": ""}
    for way in (DiskSync, AdapterSync):
        with pytest.raises(NeedsTrainer, match="is gone"):
            way.reload("http://127.0.0.1:1", gone, 1.0, False, None)

"""Which complete groups a step trains, and how the trainer drains: pure choices."""

from __future__ import annotations

from typing import get_args

import pytest

from app.config import ConfigError, load_config
from app.config.schema import DrainMode
from app.driver.selection import oldest_first


def test_oldest_dispatch_first_with_ties_broken_by_id():
    ready = [("g7", 7.0), ("g2", 2.0), ("g5", 5.0), ("b3", 3.0), ("a3", 3.0)]
    assert oldest_first(ready, 3) == ["g2", "a3", "b3"]
    assert oldest_first(ready, 10) == ["g2", "a3", "b3", "g5", "g7"]
    assert oldest_first(ready, 0) == [] and oldest_first([], 4) == []


def test_every_drain_mode_has_one_strategy():
    from workers.trainer.drain import DRAINS

    assert set(DRAINS) == set(get_args(DrainMode))
    assert all(cls.mode == mode for mode, cls in DRAINS.items())


def test_the_config_names_every_drain_mode():
    for mode in get_args(DrainMode):
        assert load_config(None, [f"gateway.drain_mode={mode}"]).gateway.drain_mode == mode
    # the config's validation is the one check of the value, before any settings are read
    with pytest.raises(ConfigError) as info:
        load_config(None, ["gateway.drain_mode=pause"])
    assert info.value.problems == ["gateway.drain_mode: value 'pause' must be one of 'wait', "
                                   "'keep', 'abort', 'continue'"]

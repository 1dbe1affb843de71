"""``carryover train --resume RUN`` goes on with the config the run started with; a config
that differs is refused, naming each key, instead of being ignored without a word."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from app.config import ConfigError, service_config
from app.driver.collector import Collector
from app.driver.loop import train
from app.state import keys


def test_resuming_with_another_config_is_refused(redis_client):
    cfg = service_config()
    Collector.create_run(redis_client, "resumed-run", OmegaConf.to_container(cfg, resolve=True),
                         "async")
    longer = OmegaConf.merge(cfg, {"trainer": {"total_steps": 500}})
    with pytest.raises(ConfigError) as err:
        train(longer, resume="resumed-run")
    assert err.value.problems[0] == (
        f"trainer.total_steps: value 500 differs from run resumed-run's "
        f"{cfg.trainer.total_steps}")
    assert len(err.value.problems) == 2 and "--resume resumed-run" in err.value.problems[1]
    assert redis_client.hget(keys.run("resumed-run"), "step") == "0"  # nothing was touched

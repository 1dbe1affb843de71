"""``carryover train --resume RUN`` goes on with the config the run started with; a file or
override that differs from it is refused, naming each key, instead of being ignored
without a word. Keys left to their defaults are not compared."""

from __future__ import annotations

import pytest

from app.cli import main
from app.config import ConfigError, service_config
from app.config.schema import Config
from app.driver.collector import Collector
from app.driver.loop import _require_same_config
from app.state import keys


def test_resuming_with_another_value_is_refused(redis_client, capsys):
    cfg = service_config()
    Collector.create_run(redis_client, "resumed-run", cfg.to_dict(),
                         "async")
    assert main(["train", "--resume", "resumed-run", "trainer.total_steps=500"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"config error: trainer.total_steps: value 500 differs from run "
                      f"resumed-run's {cfg.trainer.total_steps}")
    assert len(err) == 2 and "--resume resumed-run goes on with the config" in err[1]
    assert redis_client.hget(keys.run("resumed-run"), "step") == "0"  # nothing was touched


def test_a_finished_run_is_not_resumed(redis_client, caplog):
    """Resumed, a finished run ran its final evaluations again and appended their lines a
    second time."""
    cfg = service_config()
    Collector.create_run(redis_client, "finished-run",
                         cfg.to_dict(), "async")
    redis_client.hset(keys.run("finished-run"), mapping={"status": "finished", "step": 5})
    assert main(["train", "--resume", "finished-run"]) == 1
    assert "run finished-run already finished (5 steps)" in caplog.text


def test_an_unknown_or_half_written_run_is_one_clear_line(redis_client, caplog):
    """A mistyped id (or a run whose driver died between its record's two writes) ended in
    a MissingState traceback."""
    assert main(["train", "--resume", "no-such-run"]) == 1
    assert "--resume no-such-run: no such run in the Redis at" in caplog.text
    redis_client.hset(keys.run("half-run"), "run_id", "half-run")  # no config yet
    assert main(["train", "--resume", "half-run"]) == 1
    assert "--resume half-run: no such run" in caplog.text


def _merged(cfg: Config, over: dict) -> Config:
    """``cfg`` with the keys of ``over``'s sections replaced (a stored run's config)."""
    plain = cfg.to_dict()
    for section, values in over.items():
        plain[section] = {**plain[section], **values}
    return Config.of(plain)


def test_only_what_the_caller_set_is_compared():
    cfg = service_config()
    stored = _merged(cfg, {"trainer": {"total_steps": 7}})  # a run started with 7
    _require_same_config(cfg, stored, "r", [])  # a bare --resume: nothing to compare
    _require_same_config(stored, stored, "r", ["trainer.total_steps"])  # the same value
    with pytest.raises(ConfigError, match="trainer.total_steps: value 3 differs"):
        _require_same_config(_merged(cfg, {"trainer": {"total_steps": 3}}), stored,
                             "r", ["trainer.total_steps"])


def test_keys_inside_a_free_form_section_are_compared_one_by_one(tmp_path):
    from app.config.loader import given_keys

    cfg = service_config()
    stored = _merged(cfg, {"agent": {"a": 1, "b": 2}})
    given = _merged(cfg, {"agent": {"a": 1}})
    keys_set = given_keys(None, ["agent.a=1"])
    assert keys_set == {"agent.a"}
    _require_same_config(given, stored, "r", keys_set)  # agent.b was not given: not compared
    (tmp_path / "c.yaml").write_text("agent:\n  a: 5\n")
    with pytest.raises(ConfigError, match="agent.a: value 5 differs from run r's 1"):
        _require_same_config(_merged(cfg, {"agent": {"a": 5}}), stored, "r",
                             given_keys(tmp_path / "c.yaml"))

"""The typed configuration (app/config/schema.py) against the YAML and its validation."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from app.config import ConfigError, load_config
from app.config.schema import Config
from app.config.validate import RULES

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "config").glob("*.yaml"))


def _schema_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the schema with its type."""
    out: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out |= _schema_keys(typing.cast(type, hint), f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = hint
    return out


def _yaml_keys(node: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in RULES:
            out |= _yaml_keys(v, key + ".")
        else:
            out.add(key)
    return out


def test_the_schema_has_every_key_of_the_defaults_and_no_other() -> None:
    defaults = yaml.safe_load((REPO / "config" / "default.yaml").read_text())
    assert set(_schema_keys(Config)) == _yaml_keys(defaults)


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_config_builds(path: str) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert Config.of(cfg.to_dict()) == cfg


def _literal_choices(hint: Any) -> set[Any] | None:
    if get_origin(hint) is Literal:
        return set(get_args(hint))
    if get_origin(hint) in (typing.Union, __import__("types").UnionType):
        found = [_literal_choices(m) for m in get_args(hint)]
        lits = [c for f in found if f for c in f]
        return set(lits) | ({True, False} if bool in get_args(hint) else set()) | \
            ({None} if type(None) in get_args(hint) else set()) if lits else None
    return None


def test_literal_choices_are_the_validation_rules_choices() -> None:
    """A mode the rule accepts but the type lacks would fail at build; one the type has but
    the rule refuses would be dead: both sides list the same values."""
    checked = 0
    for key, hint in _schema_keys(Config).items():
        choices = _literal_choices(hint)
        if choices is None:
            continue
        rule = RULES[key]
        for c in choices:
            assert rule(c) is None, f"{key}: the schema takes {c!r}, validation refuses it"
        assert rule("no-such-mode") is not None, key
        checked += 1
    assert checked >= 25


def test_values_are_typed_and_frozen() -> None:
    cfg = load_config(None, ["actor_rollout_ref.actor.lr=1", "agent.depth=2"])
    assert cfg.actor_rollout_ref.actor.lr == 1.0
    assert isinstance(cfg.actor_rollout_ref.actor.lr, float)
    assert isinstance(cfg.inference.urls, tuple)
    assert cfg.agent["depth"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.total_steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.agent["depth"] = 3  # type: ignore[index]


def test_a_key_the_schema_lacks_is_named() -> None:
    plain = load_config(None).to_dict()
    plain["trainer"]["new_knob"] = 1
    with pytest.raises(ConfigError, match=r"trainer\.new_knob: not a key"):
        Config.of(plain)
    del plain["trainer"]["new_knob"]
    del plain["gateway"]["hold"]
    with pytest.raises(ConfigError, match=r"gateway\.hold: missing"):
        Config.of(plain)


def test_a_value_of_the_wrong_type_is_named() -> None:
    plain = load_config(None).to_dict()
    plain["gateway"]["drain_mode"] = "sometimes"
    with pytest.raises(ConfigError, match=r"gateway\.drain_mode: value 'sometimes'"):
        Config.of(plain)
    plain["gateway"]["drain_mode"] = "wait"
    plain["trainer"]["save_freq"] = True  # a bool is not an int here
    with pytest.raises(ConfigError, match=r"trainer\.save_freq"):
        Config.of(plain)

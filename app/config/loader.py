"""Load a run's configuration: defaults <- file <- ``a.b.c=value`` overrides.

Invariant: the ``Config`` (app.config.schema) :func:`load_config` returns has passed every rule in
``app.config.validate``, holds no unknown key, has its derived values filled in, and is
read-only.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.config.errors import ConfigError
from app.config.raw import Yaml, YamlMap, section
from app.config.schema import Config
from app.config.validate import FREE_FORM_SECTIONS, validate

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_path(p: str) -> Path:
    """A config path: absolute, or relative to the repository."""
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def model_dir(cfg: Config) -> Path:
    """``actor_rollout_ref.model.path`` as a directory that holds a model (its config.json),
    checked where a role is about to read it: nothing is downloaded, so a Hugging Face id or
    a mistyped path would otherwise fail inside vLLM or transformers with their own words."""
    given = str(cfg.actor_rollout_ref.model.path)
    path = repo_path(given)
    if not (path / "config.json").is_file():
        what = "no directory" if not path.is_dir() else "no config.json in"
        raise ConfigError([f"actor_rollout_ref.model.path: {what} {str(path)!r} (a local "
                           "model directory, absolute or relative to the repository; models "
                           f"are not downloaded; given {given!r})"])
    return path


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string; verl users write learning rates that way. A key
    given twice in one mapping is an error (PyYAML keeps the last one silently, and a
    section written twice loses the first one's keys)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False
                          ) -> dict[Hashable, object]:
        seen: dict[str, int] = {}  # a key's text: the line it is first on
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} given twice (first on line "
                    f"{seen[key_node.value]})", key_node.start_mark)
            seen[key_node.value] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _timestamp_as_text(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    # a config holds no dates (OmegaConf refuses them, with a traceback): 2024-01-01 stays
    # text, for the key's own rule to judge, as on the command line
    return loader.construct_scalar(node)  # type: ignore[arg-type]


# YAML 1.1 (PyYAML, and so OmegaConf) also reads 0100 as 64 (octal), 1:30 as 90 (base
# 60), 0x10 as 16 and yes/off as booleans. A config means none of those: in a file, a flow
# value or on the command line they stay text, for the key's own rule to judge.
_DECIMAL_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_BOOL = ("true", "false")


def _decimal_int(loader: yaml.SafeLoader, node: yaml.Node) -> int | str:
    text = loader.construct_scalar(node)  # type: ignore[arg-type]
    return loader.construct_yaml_int(node) if _DECIMAL_INT.match(text) else text


def _float_not_base_60(loader: yaml.SafeLoader, node: yaml.Node) -> float | str:
    text = loader.construct_scalar(node)  # type: ignore[arg-type]
    return text if ":" in text else loader.construct_yaml_float(node)


def _true_or_false(loader: yaml.SafeLoader, node: yaml.Node) -> bool | str:
    text = loader.construct_scalar(node)  # type: ignore[arg-type]
    return loader.construct_yaml_bool(node) if text.lower() in _BOOL else text


def _no_binary(loader: yaml.SafeLoader, node: yaml.Node) -> NoReturn:
    raise yaml.constructor.ConstructorError(None, None, "!!binary values are not supported",
                                            node.start_mark)


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp_as_text)
_Loader.add_constructor("tag:yaml.org,2002:binary", _no_binary)
_Loader.add_constructor("tag:yaml.org,2002:int", _decimal_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float_not_base_60)
_Loader.add_constructor("tag:yaml.org,2002:bool", _true_or_false)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
# and -.5 (YAML 1.1 reads .5 as a number, but a sign before the point as text)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?$"), list("-+"))
DEFAULT_CONFIG_PATH = REPO_ROOT / "config" / "default.yaml"


def flat_keys(node: Yaml, prefix: str = "", into_free_form: bool = False) -> YamlMap:
    """Every leaf key of a nested mapping as a dotted path (free-form sections are leaves,
    unless ``into_free_form``)."""
    out: YamlMap = {}
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and (into_free_form or path not in FREE_FORM_SECTIONS):
                out.update(flat_keys(value, path, into_free_form))
            else:
                out[path] = value
    return out


def _dotted_key_problems(node: Yaml, source: str, prefix: str = "") -> list[str]:
    """A key with a dot in a file (``actor.lr: 1e-2``) is one literal name to YAML: it would
    pass the unknown-key check (its dotted path is a known key) and then set nothing."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return problems
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in FREE_FORM_SECTIONS:
            continue
        if "." in str(key):
            parts = str(key).split(".")
            nested = "".join(f"{p}: {{" for p in parts[:-1]) + f"{parts[-1]}: ..." \
                + "}" * (len(parts) - 1)
            problems.append(f"{path}: a dotted key is not split in a file; nest it "
                            f"({nested}) ({source})")
        else:
            problems += _dotted_key_problems(value, source, path)
    return problems


def _unknown_key_problems(given: YamlMap, known: Iterable[str], source: str) -> list[str]:
    dotted = _dotted_key_problems(given, source)
    if dotted:
        return dotted
    known = set(known)
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k} | set(FREE_FORM_SECTIONS)
    problems = []
    for key, value in flat_keys(given).items():
        if key in FREE_FORM_SECTIONS and value is not None and not isinstance(value, dict):
            kind = "a list" if isinstance(value, list) else f"the value {value!r}"
            problems.append(f"{key}: must be a mapping (name: value), not {kind} ({source})")
            continue
        if key in known or any(key.startswith(s + ".") for s in FREE_FORM_SECTIONS):
            continue
        if key in sections:  # a section given a scalar, e.g. `data: 3`
            problems.append(f"{key}: is a section, not a value ({source})")
            continue
        hint = difflib.get_close_matches(key, sorted(known | sections), n=1, cutoff=0.6)
        suggestion = f"; did you mean '{hint[0]}'?" if hint else ""
        problems.append(f"{key}: unknown key ({source}){suggestion}")
    return problems


def _read_yaml(path: Path, label: str = "--config") -> YamlMap:
    """``label``: how the user gave the file (the option, or ``$CARRYOVER_CONFIG``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{label} {path}: cannot read file ({exc.strerror})"]) from None
    except UnicodeDecodeError as exc:
        at = path.read_bytes().count(b"\n", 0, exc.start) + 1
        raise ConfigError([f"{label} {path}: line {at}: not UTF-8 text"]) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{label} {path}:{where}: not valid YAML ({problem})"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{label} {path}: top level must be a mapping of sections"])
    return data


def _override_value(raw: str) -> Yaml:
    """A command line's value, read as verl's Hydra overrides read it (numbers, true/false,
    null, flow lists and maps); what is not valid YAML stays text."""
    if not raw.strip():
        return None
    try:
        return yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return raw


def _parse_overrides(overrides: Sequence[str]) -> tuple[YamlMap, list[str]]:
    """``a.b.c=value`` strings to a nested dict; values parsed as YAML scalars like verl/Hydra."""
    nested: YamlMap = {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"{item}: override must look like a.b.c=value")
            continue
        value = _override_value(raw)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"{item}: conflicts with another override of {part}")
                break
            node = child
        else:
            last = parts[-1]
            earlier = node.get(last)
            if isinstance(value, dict) and isinstance(earlier, dict):
                _merge_into(earlier, value)  # a later section adds to an earlier key's
            else:
                node[last] = value
    return nested, problems


def _merge_into(into: YamlMap, later: YamlMap) -> None:
    for key, value in later.items():
        earlier = into.get(key)
        if isinstance(value, dict) and isinstance(earlier, dict):
            _merge_into(earlier, value)
        else:
            into[key] = value


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: YamlMap | None = None,
    path_label: str = "--config",
) -> Config:
    """Build, validate and freeze a configuration: the typed, frozen ``Config``.

    ``base`` (a plain dict) replaces the file when given: a run's stored config is reloaded
    this way so workers see exactly what the driver validated.
    """
    defaults = _read_yaml(DEFAULT_CONFIG_PATH)
    known = flat_keys(defaults).keys()
    problems: list[str] = []

    user = base if base is not None else (_read_yaml(Path(path), path_label) if path else {})
    problems += _unknown_key_problems(user, known, str(path) if path else "config")
    cli, override_problems = _parse_overrides(overrides)
    problems += override_problems
    problems += _unknown_key_problems(cli, known, "command line")
    for source, given in ((str(path) if path else "config", user), ("command line", cli)):
        problems += [f"{key}: value ??? is OmegaConf's 'missing' marker, which would keep "
                     f"the default: give a value ({source})"
                     for key, value in flat_keys(given, into_free_form=True).items()
                     if value == "???"]
    if problems:
        raise ConfigError(problems)

    if base is not None:  # a stored config was resolved when stored: nothing to resolve
        user = {key: _literal(value) for key, value in user.items()}
    merged = OmegaConf.merge(OmegaConf.create(defaults), OmegaConf.create(user),
                             OmegaConf.create(cli))
    try:
        plain: YamlMap = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        why = str(exc).splitlines()[0]
        raise ConfigError([f"{key}: {why} (a value's ${{...}} refers to another key or "
                           "${oc.env:VAR}; write \\${ for a literal ${)"]) from None
    _fill_derived(plain)
    problems = validate(plain)
    if problems:
        raise ConfigError(problems)
    # resolved once, here: a ${ left in a value (written \${) is text from now on
    return Config.of(plain)


def _literal(node: Yaml) -> Yaml:
    """``node`` with every ``${`` escaped, so that OmegaConf keeps it as text."""
    if isinstance(node, dict):
        return {k: _literal(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_literal(v) for v in node]
    return node.replace("${", "\\${") if isinstance(node, str) else node


def given_keys(path: str | Path | None, overrides: Sequence[str] = ()) -> set[str]:
    """The keys a file and overrides set (what a user asked for, defaults aside)."""
    user = _read_yaml(Path(path)) if path else {}
    cli, _ = _parse_overrides(overrides)
    return set(flat_keys(user, into_free_form=True)) | set(flat_keys(cli, into_free_form=True))


def _fill_derived(cfg: YamlMap) -> None:
    """Documented defaults that depend on other keys."""
    async_cfg = section(cfg, "agentlightning.async_rollout")
    tbs = section(cfg, "data")["train_batch_size"]
    if async_cfg.get("async_train_batch_size") is None and isinstance(tbs, int) \
            and not isinstance(tbs, bool) and tbs > 0:
        # The recommended starting point: B_async = 2 * B_train.
        async_cfg["async_train_batch_size"] = 2 * tbs


def env_overrides() -> list[str]:
    """``$CARRYOVER_OVERRIDES``: the JSON list of a.b.c=value a parent process hands down."""
    import json
    import os

    raw = os.environ.get("CARRYOVER_OVERRIDES", "")
    try:
        overrides = json.loads(raw) if raw.strip() else []
    except json.JSONDecodeError:
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError([f"$CARRYOVER_OVERRIDES: value {raw!r} must be a JSON list of "
                           "a.b.c=value strings"])
    return overrides


def service_config() -> Config:
    """The config every long-running process reads: ``$CARRYOVER_CONFIG`` (a file) plus
    ``$CARRYOVER_OVERRIDES`` (a JSON list of a.b.c=value), over the defaults."""
    import os

    return load_config(os.environ.get("CARRYOVER_CONFIG") or None, env_overrides(),
                       path_label="$CARRYOVER_CONFIG")


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)

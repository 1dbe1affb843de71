"""The configuration as read, before it is typed: what a YAML file, a command line's
``a.b.c=value`` or a run's stored JSON holds, as the loader merges it and the rules in
``app.config.validate`` check it. Past validation the code reads ``app.config.schema.Config``.
"""

from __future__ import annotations

from typing import TypeAlias

# A YAML (or JSON) value, nested to any depth. Keys are text: YAML allows others, and the
# loader's unknown-key check names them.
Yaml: TypeAlias = "None | bool | int | float | str | list[Yaml] | dict[str, Yaml]"
# A mapping of such values: a whole configuration, or one section of it.
YamlMap: TypeAlias = "dict[str, Yaml]"


def at(cfg: YamlMap, key: str) -> Yaml:
    """The value at a dotted ``key`` (``"trainer.nnodes"``); a KeyError when a part of it is
    missing, a TypeError when a part of it is a value, not a section."""
    node: Yaml = cfg
    for part in key.split("."):
        if not isinstance(node, dict):
            raise TypeError(f"{key}: {part!r} is read in {node!r}, which is not a mapping")
        node = node[part]
    return node


def section(cfg: YamlMap, key: str) -> YamlMap:
    """The mapping at a dotted ``key`` (``"algorithm.overlong"``), as :func:`at` reads it."""
    node = at(cfg, key)
    if not isinstance(node, dict):
        raise TypeError(f"{key}: {node!r} is not a mapping (a section)")
    return node

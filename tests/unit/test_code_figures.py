"""scripts/code_figures.py: the shape figures count Any however a signature spells it."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("code_figures", ROOT / "scripts/code_figures.py")
code_figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_figures)

MODULE = '''
import typing
from typing import TYPE_CHECKING, Any, Literal

Row = dict[str, Any]
Rows = list[Row]
Loose = typing.Any
if TYPE_CHECKING:
    Pair = tuple[Any, int]


def plain(a: int) -> str: ...
def direct(a: Any) -> None: ...
def json_object(a: dict[str, Any]) -> None: ...
def alias(a: Row) -> None: ...
def alias_of_alias(a: Rows) -> None: ...
def attribute_alias(a: Loose) -> None: ...
def guarded_alias(a: Pair) -> None: ...
def bare(a: dict) -> list: ...
def quoted_bare(a: "list") -> None: ...
def literal_words(a: Literal["dict", "list"]) -> tuple[int, ...]: ...
def untyped(a, b: int): ...
'''


def test_any_behind_an_alias_counts_and_a_bare_generic_is_counted_apart(tmp_path):
    for package in ("app", "gateway", "workers"):
        (tmp_path / package).mkdir()
    (tmp_path / "app" / "m.py").write_text(textwrap.dedent(MODULE))
    figures = code_figures.figures(tmp_path)
    assert figures["functions"] == 11
    assert figures["aliases_holding_any"] == ["Loose", "Pair", "Row", "Rows"]
    # direct, json_object, alias, alias_of_alias, attribute_alias, guarded_alias
    assert figures["any_in_signature"]["count"] == 6
    # all but the JSON-object dict
    assert figures["any_except_json_dicts"]["count"] == 5
    assert figures["bare_generic_in_signature"]["count"] == 2  # bare, quoted_bare
    assert figures["not_fully_annotated"]["count"] == 1  # untyped

"""Figures of the code's shape in app/, gateway/ and workers/, printed as JSON.

Functions (defs and methods), those with ``Any`` in a parameter or return annotation (also
counted without JSON-object dicts, ``dict[str, Any]`` / ``Mapping[str, Any]``, and without
app/config/validate.py, whose checks take arbitrary input by design; an annotation that
names a module-level alias holding ``Any`` counts as ``Any``), those with a generic left
bare (``-> dict``, an ``Any`` the word does not show), those not fully annotated (a
parameter or the return: mypy does not check inside them), functions over 60
lines, the largest modules, and raw reads of the policy version outside
``app.state.policy.current_version``.

Usage: .venv/bin/python scripts/code_figures.py [REPO]
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("app", "gateway", "workers")
LONG = 60
ANY = re.compile(r"\bAny\b")
JSON_DICT = re.compile(r"(dict|Mapping)\[str, Any\]")
RAW_VERSION_READ = re.compile(r"int\(\w+\.get\(keys\.policy_version\(\)\)")


def _annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
    found = [ast.unparse(x.annotation) for x in args if x.annotation is not None]
    return found + ([ast.unparse(fn.returns)] if fn.returns is not None else [])


GENERICS = {"dict", "list", "tuple", "set", "frozenset", "type", "Callable", "Mapping",
            "MutableMapping", "Sequence", "Iterable", "Iterator", "Generator"}


def _bare_generic(annotation: str) -> bool:
    """``annotation`` names a generic without its type arguments (``-> dict``): an ``Any``
    the word does not show."""
    tree = ast.parse(annotation, mode="eval")
    subscripted = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
    literal = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Subscript)
               and ast.unparse(n.value).endswith("Literal") for c in ast.walk(n.slice)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in literal:
            if _bare_generic(node.value):  # a quoted annotation
                return True
        name = node.id if isinstance(node, ast.Name) else \
            node.attr if isinstance(node, ast.Attribute) else None
        if name in GENERICS and id(node) not in subscripted:
            return True
    return False


def _unannotated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A parameter (but self and cls) or the return is not annotated."""
    a = fn.args
    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
    return fn.returns is None or any(
        x.annotation is None and x.arg not in ("self", "cls") for x in args)


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's top-level statements, and those inside its top-level ``if`` and ``try``
    blocks (``if TYPE_CHECKING:``, an import fallback)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ())),
                          getattr(node, "finalbody", [])):
                yield from _module_statements(block)


def _any_aliases(trees: dict[str, ast.Module]) -> set[str]:
    """Names bound at module level to a value that holds ``Any``, or another such name
    (``Metrics = dict[str, Any]``, ``Rows = list[Metrics]``): an annotation naming one
    counts as ``Any``, so an alias cannot hide it."""
    bound: list[tuple[str, str]] = []
    for tree in trees.values():
        for node in _module_statements(tree.body):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if isinstance(target, ast.Name):
                bound.append((target.id, ast.unparse(value)))
    names: set[str] = set()
    while True:  # until no alias of an alias is left to find
        words = re.compile(r"\b(" + "|".join(["Any", *sorted(names)]) + r")\b")
        found = {name for name, value in bound if words.search(value)} - names
        if not found:
            return names
        names |= found


def figures(repo: Path) -> dict:
    functions = with_any = without_json = without_validator = bare = unannotated = 0
    long: list[tuple[int, str]] = []
    modules: list[tuple[int, str]] = []
    raw_reads = 0
    texts = {path.relative_to(repo).as_posix(): path.read_text()
             for package in PACKAGES for path in sorted((repo / package).rglob("*.py"))}
    trees = {name: ast.parse(text) for name, text in texts.items()}
    aliases = _any_aliases(trees)
    any_ = re.compile(r"\b(" + "|".join(["Any", *sorted(aliases)]) + r")\b")
    for name, text in texts.items():
        modules.append((len(text.splitlines()), name))
        if name != "app/state/policy.py":
            raw_reads += len(RAW_VERSION_READ.findall(text))
        for node in ast.walk(trees[name]):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            functions += 1
            lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
            if lines > LONG:
                long.append((lines, f"{name}:{node.name}"))
            annotations = _annotations(node)
            bare += any(_bare_generic(t) for t in annotations)
            unannotated += _unannotated(node)
            if any(any_.search(t) for t in annotations):
                with_any += 1
                if any(any_.search(JSON_DICT.sub("J", t)) for t in annotations):
                    without_json += 1
                    without_validator += name != "app/config/validate.py"
    share = lambda n: round(100 * n / functions, 1)  # noqa: E731
    return {
        "functions": functions,
        "aliases_holding_any": sorted(aliases),
        "any_in_signature": {"count": with_any, "percent": share(with_any)},
        "any_except_json_dicts": {"count": without_json, "percent": share(without_json)},
        "any_except_json_dicts_and_validator": {"count": without_validator,
                                                "percent": share(without_validator)},
        "bare_generic_in_signature": {"count": bare, "percent": share(bare)},
        "not_fully_annotated": {"count": unannotated, "percent": share(unannotated)},
        f"functions_over_{LONG}_lines": sorted(long, reverse=True),
        "largest_modules": sorted(modules, reverse=True)[:5],
        "raw_policy_version_reads": raw_reads,
    }


if __name__ == "__main__":
    print(json.dumps(figures(Path(sys.argv[1] if len(sys.argv) > 1 else ".")), indent=1))

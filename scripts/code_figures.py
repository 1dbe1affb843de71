"""Figures of the code's shape in app/, gateway/ and workers/, printed as JSON.

Functions (defs and methods), those with ``Any`` in a parameter or return annotation (also
counted without JSON-object dicts, ``dict[str, Any]`` / ``Mapping[str, Any]``, and without
app/config/validate.py, whose checks take arbitrary input by design; an annotation that
names a module-level alias holding ``Any`` counts as ``Any``), functions over 60
lines, the largest modules, and raw reads of the policy version outside
``app.state.policy.current_version``.

Usage: .venv/bin/python scripts/code_figures.py [REPO]
"""

from __future__ import annotations

import ast
import json
import re
import sys
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


def _any_aliases(trees: dict[str, ast.Module]) -> set[str]:
    """Names bound at module level to a type that holds ``Any`` (``Metrics = dict[str,
    Any]``): an annotation naming one counts as ``Any``, so an alias cannot hide it."""
    names = set()
    for tree in trees.values():
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            if isinstance(target, ast.Name) and isinstance(
                    value, ast.Subscript | ast.BinOp | ast.Constant | ast.Name) \
                    and ANY.search(ast.unparse(value)):
                names.add(target.id)
    return names


def figures(repo: Path) -> dict:
    functions = with_any = without_json = without_validator = 0
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
        f"functions_over_{LONG}_lines": sorted(long, reverse=True),
        "largest_modules": sorted(modules, reverse=True)[:5],
        "raw_policy_version_reads": raw_reads,
    }


if __name__ == "__main__":
    print(json.dumps(figures(Path(sys.argv[1] if len(sys.argv) > 1 else ".")), indent=1))

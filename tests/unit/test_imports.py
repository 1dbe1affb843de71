"""Light edges: the CLI and the gateway start without importing torch or verl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LIGHT = ["app.cli", "gateway", "gateway.routes.openai", "app.celery_app"]


@pytest.mark.parametrize("module", LIGHT)
def test_light_import(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'verl', 'transformers') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == ""


def _imports_of(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """Every import statement under ``package`` (top level or inside a function) that names
    one of the ``forbidden`` top-level packages."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    offenders = []
    for path in (repo / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(repo)}: {n}" for n in names
                          if n.split(".")[0] in forbidden]
    return offenders


def test_app_never_imports_workers_or_gateway():
    """Data flows one way: the driver sends tasks by name and never imports a role's code;
    what the roles share (keys, records, the pause protocol) lives in ``app.state``."""
    assert _imports_of("app", ("workers", "gateway")) == []


def test_workers_never_import_the_gateway():
    """The trainer pauses the gateway through ``app.state.pause``, not the gateway's code."""
    assert _imports_of("workers", ("gateway",)) == []


def test_gateway_never_imports_workers():
    assert _imports_of("gateway", ("workers",)) == []


def test_the_gateway_config_file_imports_no_redis_before_gevent_patches():
    """gunicorn reads its config file in the master, before a worker patches with gevent: a
    ``redis`` (or ``app.state.connection``) imported there keeps unpatched sockets and a
    thread-local that every greenlet of a worker would share."""
    code = ("import runpy, sys; runpy.run_path('gateway/gunicorn.conf.py'); "
            "print(','.join(m for m in ('redis', 'app.state.connection')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=str(REPO))
    assert out.stdout.strip() == ""

"""Light edges: the CLI and the gateway start without importing torch or verl."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT = ["app.cli", "gateway", "gateway.routes.openai", "app.celery_app"]


@pytest.mark.parametrize("module", LIGHT)
def test_light_import(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'verl', 'transformers') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_app_never_imports_workers():
    """Data flows one way: the driver sends tasks by name and never imports worker code."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "app"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(root.parent)}: {n}" for n in names
                          if n == "workers" or n.startswith("workers.")]
    assert offenders == []

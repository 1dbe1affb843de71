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

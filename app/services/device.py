"""Which accelerator this host has, decided without importing torch (the CLI stays light).

``CARRYOVER_DEVICE=cpu|cuda`` forces the answer (``scripts/setup.sh`` honours the same
variable, so the environment and the commands agree); otherwise CUDA when ``nvidia-smi`` lists
a GPU.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess


@functools.cache
def host_device() -> str:
    forced = os.environ.get("CARRYOVER_DEVICE", "auto").strip().lower() or "auto"
    if forced in ("cpu", "cuda"):
        return forced
    if forced != "auto":  # as scripts/setup.sh refuses it: a typo must not pick silently
        from app.config.errors import ConfigError

        raise ConfigError([f"$CARRYOVER_DEVICE: value {forced!r} must be cpu, cuda or auto"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if out.returncode == 0 and "GPU" in out.stdout else "cpu"


def resolve(setting: str) -> str:
    """A config's ``auto | cpu | cuda`` as the device to use."""
    return host_device() if setting == "auto" else setting

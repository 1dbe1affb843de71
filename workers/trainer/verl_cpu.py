"""A CPU platform for verl, registered from outside verl.

verl 0.9.1 knows the nvidia, npu and rocm platforms only; without an accelerator it assumes
nvidia and calls ``torch.cuda``. This module gives it a ``cpu`` platform through verl's own
platform registry and registers verl's FSDP engines for device ``cpu``. No verl file is
edited or copied.

Every rank must import it before verl resolves its platform: ``activate()`` sets
``VERL_USE_EXTERNAL_MODULES`` (verl imports the named modules when ``verl`` itself is first
imported, in every process that inherits the environment, Ray workers included) and
``VERL_PLATFORM=cpu``, then registers in this process.

Invariant: ``current_device()`` returns the *string* ``"cpu"``: verl passes it straight to
``.to(...)``, where an int 0 would mean ``cuda:0``.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from typing import Any

import torch

MODULE = __name__


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module."""
    mod: Any = types.ModuleType("carryover_cpu_device")  # attributes set below
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    zero = (lambda *a, **k: 0)  # noqa: E731
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        setattr(mod, name, zero)
    mod.empty_cache = lambda: None
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.mem_get_info = lambda *a, **k: (0, 0)
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.set_device = lambda *a, **k: None
    mod.synchronize = lambda *a, **k: None
    mod.memory_stats = lambda *a, **k: {}
    return mod


_registered = False


def register() -> None:
    """Register the platform and the FSDP engines for ``cpu`` (idempotent)."""
    global _registered
    if _registered:
        return
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    module = _device_module()

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return os.environ.get("VERL_PLATFORM", "").lower() == "cpu"

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CARRYOVER_VISIBLE_CPUS"

        @contextmanager
        def nvtx_range(self, msg: str):  # type: ignore[override]
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def ray_resource_options(self, num_gpus: float) -> dict[str, float]:
            return {"num_cpus": num_gpus}

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformRegistry.register(platform="cpu")(PlatformCPU)

    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import (
        FSDPEngineWithLMHead,
        FSDPEngineWithValueHead,
    )

    engines = EngineRegistry._engines
    if "cpu" not in engines.get("language_model", {}).get("fsdp", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"],
                                device="cpu")(FSDPEngineWithLMHead)
        EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"],
                                device="cpu")(FSDPEngineWithValueHead)
    _registered = True


def activate() -> None:
    """Make verl run on the CPU in this process and in every process started from it."""
    os.environ["VERL_PLATFORM"] = "cpu"
    mods = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if MODULE not in mods:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*mods, MODULE])
    register()


# Imported by verl through VERL_USE_EXTERNAL_MODULES: register at import, but only when the
# environment asks for the CPU platform (a GPU rank that inherited the module list must not).
if os.environ.get("VERL_PLATFORM", "").lower() == "cpu" and "verl" in sys.modules:
    try:
        register()
    except ImportError:  # verl is still importing us from its __init__; activate() registers
        pass

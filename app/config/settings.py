"""Values derived from the typed configuration (``app.config.schema.Config``) that more
than one role needs, and the inference servers' settings as the trainer drives them.

Each function resolves one ``auto`` or cross-key choice in one place (the server command and
the trainer both call ``transfer_engine``, so they cannot disagree). The trainer's own view
is ``workers.trainer.settings.TrainerSettings``, the gateway's
``gateway.settings.GatewaySettings``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from app.config.errors import ConfigError
from app.config.schema import Config, WeightSyncWay
from app.services.device import resolve as resolve_device

WeightSync = WeightSyncWay
TransferEngine = Literal["shm", "ipc"]  # transfer_engine once auto is resolved
# the values vLLM's --max-lora-rank takes
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_dtype(dtype: str, model_path: str | Path | None = None) -> str:
    """The dtype an inference server computes in for ``inference.dtype``. ``auto`` is
    vLLM's: the checkpoint's dtype, except that a float32 checkpoint (or one that names
    none) is served in the platform's preferred dtype, bfloat16 on x86 and ARM CPUs and on
    Ampere or later GPUs (``_resolve_auto_dtype`` in vllm/config/model.py; an older GPU
    takes float16: name ``inference.dtype`` there)."""
    if dtype != "auto":
        return dtype
    name = "float32"
    config = Path(model_path) / "config.json" if model_path is not None else None
    if config is not None and config.exists():
        hf = json.loads(config.read_text())
        name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return "bfloat16" if name == "float32" else name


def lora_rank(cfg: Config) -> int:
    """``actor_rollout_ref.model.lora_rank``: 0 = every weight is trained."""
    return cfg.actor_rollout_ref.model.lora_rank


def adapter_name(model: str, version: int) -> str:
    """The name the servers serve policy ``version``'s LoRA adapter under."""
    return f"{model}-v{version}"
Launcher = Literal["auto", "local", "ray"]


def sleep_mode(cfg: Config, device: str) -> bool:
    """Whether the server starts with ``--enable-sleep-mode``: on GPU when the update runs
    with the gateway paused (collocated: the engine sleeps and lends its memory to the
    update), unless ``gateway.drain_mode`` is ``keep`` (calls frozen across the update keep
    their KV cache in the engine's memory). vLLM refuses the flag on CPU, where sleeping frees
    nothing."""
    if device != "cuda":
        return False
    setting = cfg.inference.sleep_mode
    if setting == "auto":
        pause = cfg.trainer.pause_during_update
        return pause in ("auto", True) and cfg.gateway.drain_mode != "keep"
    return bool(setting)


def transfer_engine(cfg: Config, device: str) -> TransferEngine:
    """The engine of ``inference.weight_sync: transfer`` (``inference.transfer_engine``):
    ``ipc`` (vLLM's CUDA IPC engine: each server worker maps the trainer's copy on its own
    GPU) or ``shm`` (the project's engine: buckets in the host's shared memory). ``auto``:
    ``ipc`` when trainer and servers run on CUDA and the update is collocated
    (``trainer.pause_during_update`` auto or true: they share the GPUs), ``shm`` elsewhere.
    The server command and the trainer both read it here, so they cannot disagree."""
    value = cfg.inference.transfer_engine
    if value == "auto":
        pause = cfg.trainer.pause_during_update
        trainer_device = resolve_device(str(cfg.trainer.device))
        return "ipc" if device == trainer_device == "cuda" and pause in ("auto", True) \
            and _ipc_layout_problem(cfg, device) is None else "shm"
    # ConfigError: the CLI prints it as a config error (exit 2), not a traceback
    if value == "ipc" and device != "cuda":
        raise ConfigError([f"inference.transfer_engine: value 'ipc' hands GPU memory over, "
                           f"and the servers run on {device}: use shm or auto"])
    if value == "ipc" and (problem := _ipc_layout_problem(cfg, device)):
        raise ConfigError([f"inference.transfer_engine: value 'ipc' {problem}: use shm or "
                           "auto"])
    return value


def launcher(cfg: Config, device: str) -> str:
    """``trainer.launcher``; ``auto`` = verl's Ray worker group when the update spans more
    than one accelerator, else ranks on this host."""
    tr = cfg.trainer
    if tr.launcher != "auto":
        return str(tr.launcher)
    gpus = int(tr.nnodes) * int(tr.n_gpus_per_node)
    return "ray" if device == "cuda" and gpus > 1 else "local"


def _ipc_layout_problem(cfg: Config, device: str) -> str | None:
    """Why the trainer's GPUs and the server's are not the same ones, one to one, which
    ``ipc`` needs, or None. Every trainer rank exports each bucket on its GPU, and torch frees
    an export only once the server worker on that GPU has opened and released it: an export
    no worker opens (a second server out of a sync, a trainer GPU no server uses) is GPU
    memory lost every sync, and a worker whose GPU has no export fails."""
    inf, tr = cfg.inference, cfg.trainer
    servers = len(inf.urls or [None])
    gpus = int(inf.tensor_parallel_size) * int(inf.data_parallel_size)
    ranks = int(tr.nnodes) * int(tr.n_gpus_per_node) if launcher(cfg, device) == "ray" \
        else int(tr.ranks)
    if servers != 1:
        return (f"needs one server on the trainer's GPUs, and inference.urls names {servers} "
                "(an export a server out of the sync never opens is GPU memory lost)")
    if ranks != gpus:
        return (f"needs the trainer's GPUs to be the server's, one to one: the trainer has "
                f"{ranks} rank(s), the server {gpus} GPU(s) (inference.tensor_parallel_size "
                "x data_parallel_size)")
    return None


@dataclass(frozen=True)
class InferenceSettings:
    """The inference servers as the trainer drives them."""

    urls: tuple[str, ...]
    served_model_name: str
    device: str            # resolved: cpu | cuda
    dtype: str             # what the server computes in (auto: the checkpoint's)
    sleep_mode: bool       # the servers were started with --enable-sleep-mode
    sleep_level: int
    data_parallel_size: int  # engine replicas inside each server: each is probed
    weight_sync: WeightSync = "disk"
    transfer_engine: TransferEngine = "shm"
    transfer_bucket_bytes: int = 256 << 20
    transfer_checksums: bool = True
    lora: bool = False     # the servers serve each version as a LoRA adapter (adapter_name)

    @classmethod
    def from_config(cls, cfg: Config) -> InferenceSettings:
        inf = cfg.inference
        device = resolve_device(str(inf.device))
        return cls(urls=tuple(str(u) for u in inf.urls),
                   served_model_name=str(inf.served_model_name), device=device,
                   dtype=str(inf.dtype), sleep_mode=sleep_mode(cfg, device),
                   sleep_level=int(inf.sleep_level),
                   data_parallel_size=int(inf.data_parallel_size) if device == "cuda" else 1,
                   weight_sync=cast(WeightSync, str(inf.weight_sync)),
                   # read only under weight_sync transfer (the server command's rule)
                   transfer_engine=transfer_engine(cfg, device)
                   if inf.weight_sync == "transfer" else "shm",
                   transfer_bucket_bytes=int(float(inf.transfer_bucket_mb) * (1 << 20)),
                   transfer_checksums=bool(inf.transfer_checksums),
                   lora=lora_rank(cfg) > 0)


"""How many tokens one micro-batch may hold (``ppo_max_token_len_per_gpu: auto``).

What a micro-batch's forward and backward add to a rank's memory grows with its tokens: the
activations every decoder layer keeps for the backward pass, and the logits over the whole
vocabulary with their log-softmax and gradients. Weights, gradients and optimizer state do
not grow with it. So the bound is the memory a micro-batch may take
(``actor.micro_batch_memory_gb``) divided by what one token costs (``bytes_per_token``).
By default that memory is a share of what a rank has left once its engine is built and what
a step adds besides the micro-batches is set aside (``step_reserve``): the rank's shard of
the gradients and optimizer state, and the few FSDP units held gathered at a time, never the
whole model (FSDP2 gathers one unit, a decoder layer, at a time).

The coefficients come from the peak resident memory of verl 0.9.1's update on CPU (fp32, the
padded forward, sdpa) on Llama/Qwen2 shapes of 2 to 30 layers, hidden 128 to 1,152,
vocabularies of 27 to 49,152, rows of 256 to 1,024 tokens, rounded up: the estimate is 1.0 to
1.7 times what was measured (docs/gpu.md#micro-batch-memory has the figures).
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# per token and decoder layer (and once more for the embeddings, the final norm and the
# backward's transients), in elements of the compute dtype
HIDDEN_PER_LAYER = 10
INTERMEDIATE_PER_LAYER = 5
# per token, float32 copies of the vocabulary: the logits, their log-softmax, the
# gradients of both
LOGIT_COPIES = 4
# bytes a step adds after the engine is built, per parameter of an FSDP unit held gathered:
# the unit's parameters in the compute dtype and its full gradients before their
# reduce-scatter (float32: 4 + 4; bfloat16: 2 + 2, and the float32 copy FSDP reduces, 4)
GATHERED_BYTES_PER_PARAM = 8
# units held gathered at once besides the root: the one running and the next, which FSDP2
# gathers ahead (implicit prefetching, forward and backward)
UNITS_GATHERED_AT_ONCE = 2
# per trainable parameter, divided among the ranks: the gradient shard and AdamW's two
# moments, float32 (verl keeps fp32 master weights)
STATE_BYTES_PER_TRAINABLE = 12
# share of what is left that micro-batches may take by default: the estimate is not exact,
# allocators keep freed memory, and on a shared host the other processes grow too
AUTO_SHARE = 0.5

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int


def model_shape(hf_config: PretrainedConfig) -> ModelShape:
    """The sizes the per-token cost depends on, from a Hugging Face config (a multimodal
    model's text part)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    hidden = int(cfg.hidden_size)
    intermediate = getattr(cfg, "intermediate_size", None) or 4 * hidden
    return ModelShape(vocab=int(cfg.vocab_size), hidden=hidden,
                      intermediate=int(intermediate), layers=int(cfg.num_hidden_layers))


def bytes_per_token(shape: ModelShape, compute_bytes: int, checkpointing: bool) -> int:
    """Peak memory one token of a micro-batch costs in the update's forward and backward.
    With gradient checkpointing a layer keeps only its input; one layer at a time holds its
    activations again while the backward recomputes it."""
    per_layer = HIDDEN_PER_LAYER * shape.hidden + INTERMEDIATE_PER_LAYER * shape.intermediate
    kept = shape.layers * shape.hidden + 2 * per_layer if checkpointing \
        else (shape.layers + 1) * per_layer
    return compute_bytes * kept + 4 * LOGIT_COPIES * shape.vocab


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def proc_kb(path: Path, names: Iterable[str]) -> dict[str, int]:
    """The fields ``names`` of a /proc file of ``Name:  <n> kB`` lines (``/proc/meminfo``,
    ``/proc/self/status``), in bytes; a field the file lacks is left out."""
    wanted = set(names)
    out = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in wanted:
            out[name] = int(rest.split()[0]) * 1024
    return out


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        return proc_kb(meminfo, ["MemAvailable"]).get("MemAvailable")
    except (OSError, ValueError, IndexError):
        return None


def _own_cgroup(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory path) of this process."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _cgroup_headroom(root: Path, proc_cgroup: Path) -> int | None:
    """What this process's memory cgroup still lets it take (v2, then v1), or None without a
    limit. The cgroup's own directory may not be visible (a container sees its cgroup as the
    root): then the root's files are read."""
    v2, v1 = _own_cgroup(proc_cgroup)
    candidates: list[tuple[Path, str, str]] = []
    if v2 is not None:
        for base in (root / v2.lstrip("/"), root):
            candidates.append((base, "memory.max", "memory.current"))
    if v1 is not None:
        for base in (root / "memory" / v1.lstrip("/"), root / "memory"):
            candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for base, limit_file, usage_file in candidates:
        limit, usage = _read_int(base / limit_file), _read_int(base / usage_file)
        if limit is None or usage is None:
            continue  # "max" (no limit) or not this directory
        if limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, limit - usage)
    return None


def _rlimit_headroom() -> int | None:
    """What ``ulimit -d`` / ``-v`` (RLIMIT_DATA, RLIMIT_AS) still allow this process."""
    try:
        used = proc_kb(Path("/proc/self/status"), ["VmData", "VmSize"])
    except OSError:
        return None
    out = None
    for limit_name, key in (("RLIMIT_DATA", "VmData"), ("RLIMIT_AS", "VmSize")):
        soft, _ = resource.getrlimit(getattr(resource, limit_name))
        if soft != resource.RLIM_INFINITY and key in used:
            room = max(0, soft - used[key])
            out = room if out is None else min(out, room)
    return out


def available_bytes(device: str, root: Path = Path("/sys/fs/cgroup"),
                    meminfo: Path = Path("/proc/meminfo"),
                    proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Memory this rank could still take: on CUDA its GPU's free memory; on the CPU the
    least of the host's available memory, the memory cgroup's headroom and the process's
    resource limits."""
    if device != "cpu":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    found = [v for v in (_meminfo_available(meminfo), _cgroup_headroom(root, proc_cgroup),
                         _rlimit_headroom()) if v is not None]
    return min(found) if found else 0


def step_reserve(units: Sequence[int], trainable: int, world: int) -> int:
    """Bytes a step adds to one rank's memory once the engine is built, the micro-batches
    aside: this rank's shard of the gradients and of AdamW's moments, and the FSDP units held
    gathered at once, each with its full gradients: the root (``units[0]``, which FSDP2 keeps
    gathered from the forward through the backward) and the ``UNITS_GATHERED_AT_ONCE``
    largest others. ``units``: each unit's parameters, full size (``RankEngine.fsdp_units``);
    ``world``: the ranks the optimizer state is sharded over."""
    root, *others = units or [0]
    gathered = root + sum(sorted(others, reverse=True)[:UNITS_GATHERED_AT_ONCE])
    return GATHERED_BYTES_PER_PARAM * gathered + \
        STATE_BYTES_PER_TRAINABLE * trainable // max(world, 1)


def auto_budget(available: int, reserve: int, sharing: int) -> int:
    """``micro_batch_memory_gb: auto`` in bytes: ``AUTO_SHARE`` of what is ``available``
    once every rank drawing on that memory (``sharing``: ranks on one host's CPU) has set its
    ``step_reserve`` aside, split among them."""
    sharing = max(sharing, 1)
    return max(0, int(AUTO_SHARE * (available - sharing * reserve) / sharing))


def max_token_len(budget: int, per_token: int) -> int:
    """Tokens per micro-batch that fit ``budget``; at least 1 (a row longer than the bound
    runs alone in its micro-batch anyway)."""
    return max(1, math.floor(budget / max(per_token, 1)))


def sharing_ranks(device: str) -> int:
    """Ranks drawing on this rank's memory: every local rank on the CPU, one per GPU."""
    if device != "cpu":
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)

"""The default token bound of a micro-batch (``ppo_max_token_len_per_gpu: auto``): the
per-token cost, the budget, the memory left as read from the host, its cgroup and the
process's limits, and when verl's token-count cut is used."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from app.config import load_config
from app.config.loader import REPO_ROOT
from workers.trainer import token_budget as tb
from workers.trainer.engine_config import engine_spec
from workers.trainer.ranks import RankEngine

SMOLLM2 = REPO_ROOT / "var" / "models" / "smollm2-135m-instruct"


def _vm(key: str) -> int:
    return tb.proc_kb(Path("/proc/self/status"), [key])[key]


def test_bytes_per_token_of_smollm2():
    """SmolLM2-135M: 30 layers of hidden 576 and MLP 1,536, a vocabulary of 49,152."""
    shape = tb.ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30)
    fp32 = tb.bytes_per_token(shape, 4, checkpointing=False)
    assert fp32 == 4 * 31 * (10 * 576 + 5 * 1536) + 16 * 49152 == 2452992
    assert tb.bytes_per_token(shape, 2, checkpointing=False) < fp32  # bf16 activations
    assert tb.bytes_per_token(shape, 4, checkpointing=True) < fp32 / 2
    if (SMOLLM2 / "config.json").exists():
        from transformers import AutoConfig

        assert tb.model_shape(AutoConfig.from_pretrained(SMOLLM2)) == shape


# FSDP units of Qwen2.5-7B (hidden 3,584, MLP 18,944, 28 query and 4 key-value heads of
# 128, biased q/k/v, untied vocabulary of 152,064) as verl wraps them: the root (the final
# norm), the embedding, 28 decoder layers, the head
QWEN7B_LAYER = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 \
    + 3 * 3584 * 18944 + 2 * 3584
QWEN7B_VOCAB = 152064 * 3584
QWEN7B_UNITS = [3584, QWEN7B_VOCAB] + [QWEN7B_LAYER] * 28 + [QWEN7B_VOCAB]
QWEN7B = tb.ModelShape(vocab=152064, hidden=3584, intermediate=18944, layers=28)
# SmolLM2-135M: the root holds the tied embedding and the final norm; 30 layers
SMOL_LAYER = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
SMOL_UNITS = [49152 * 576 + 576] + [SMOL_LAYER] * 30


def _qwen7b_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int) -> RankEngine:
    """A rank of ``config/examples/qwen2.5-7b-8gpu.yaml`` with its bound on auto, as its
    engine would stand once built on one of 8 GPUs with ``free`` bytes left: the model's
    config alone on disk, the engine's counts given."""
    import json

    import torch.distributed as dist

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}))
    cfg = load_config(REPO_ROOT / "config" / "examples" / "qwen2.5-7b-8gpu.yaml",
                      ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=auto"])
    rank = object.__new__(RankEngine)
    rank.spec = engine_spec(cfg, str(tmp_path), 0)
    params = sum(QWEN7B_UNITS)
    rank.fsdp_units = lambda: QWEN7B_UNITS
    rank.parameter_count = lambda: params
    rank.trainable_count = lambda: params
    monkeypatch.setattr(tb, "available_bytes", lambda device: free)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    return rank


def test_a_gpu_rank_sets_aside_its_shard_and_the_units_gathered_not_the_whole_model(
        tmp_path, monkeypatch):
    """Qwen2.5-7B over 8 GPUs of 80 GB, vLLM holding half: about 35 GB free once the engine
    is built. Each rank adds its eighth of the gradients and AdamW's moments (11.4 GB) and,
    gathered with their gradients, the root and the two largest units (the embedding and the
    head, 8.7 GB). Counting 8 bytes for every parameter of the model instead (61 GB) left
    nothing: a bound of 1 token, every micro-batch one row."""
    params = sum(QWEN7B_UNITS)
    assert 7.6e9 < params < 7.7e9
    bound = _qwen7b_rank(tmp_path, monkeypatch, 35 * 10**9)._token_bound()
    # bfloat16 with gradient checkpointing: 3.16 MB a token, two rows of 1,024 and more
    assert bound["bytes_per_token"] == tb.bytes_per_token(QWEN7B, 2, True) == 3155968
    assert 2300 < bound["max_token_len"] < 2400
    reserve = 12 * params // 8 + 8 * (3584 + 2 * QWEN7B_VOCAB)
    assert bound["reserve_bytes"] == reserve and 20e9 < reserve < 20.2e9
    assert bound["budget_bytes"] == int(0.5 * (35 * 10**9 - reserve))  # one rank per GPU
    # a model twice as deep holds no more units gathered at once; more ranks, less state
    assert tb.step_reserve(QWEN7B_UNITS + [QWEN7B_LAYER] * 28, params, 8) == reserve
    assert tb.step_reserve(QWEN7B_UNITS, params, 64) < reserve


def test_the_reserve_on_one_cpu_rank_and_ranks_sharing_a_host():
    """SmolLM2-135M on one CPU rank: the whole gradient and AdamW state (1.61 GB) and the
    root (the tied embedding) with two layers gathered (0.28 GB). Ranks on one host's CPU
    draw on the same memory: each one's reserve is set aside before it is split."""
    params = sum(SMOL_UNITS)
    assert params == 134515008
    reserve = tb.step_reserve(SMOL_UNITS, params, 1)
    assert reserve == 12 * params + 8 * (SMOL_UNITS[0] + 2 * SMOL_LAYER) == 1897318656
    per_token = tb.bytes_per_token(tb.ModelShape(49152, 576, 1536, 30), 4, False)
    # docs/gpu.md: 16 GB left on a 24 GB host
    assert tb.max_token_len(tb.auto_budget(16 * 10**9, reserve, 1), per_token) == 2874
    two = tb.step_reserve(SMOL_UNITS, params, 2)
    assert two == 6 * params + 8 * (SMOL_UNITS[0] + 2 * SMOL_LAYER)
    assert tb.auto_budget(16 * 10**9, two, 2) == int(0.5 * (16 * 10**9 - 2 * two) / 2)
    assert tb.auto_budget(10**9, reserve, 1) == 0
    assert tb.max_token_len(0, 1000) == 1  # a row longer than the bound runs alone
    assert tb.step_reserve([], 0, 1) == 0


def _cgroup_files(tmp_path: Path, v2: dict[str, str] | None, v1: dict[str, str] | None,
                  self_cgroup: str) -> tuple[Path, Path, Path]:
    root = tmp_path / "cgroup"
    for base, files in ((root / "my.slice", v2), (root / "memory" / "job", v1)):
        if files is not None:
            base.mkdir(parents=True)
            for name, value in files.items():
                (base / name).write_text(value + "\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    proc = tmp_path / "cgroup.proc"
    proc.write_text(self_cgroup)
    return root, meminfo, proc


@pytest.mark.parametrize("v2, v1, expected", [
    # cgroup v2: memory.max less memory.current
    ({"memory.max": "8000000000", "memory.current": "3000000000"}, None, 5_000_000_000),
    ({"memory.max": "max", "memory.current": "3000000000"}, None, 20_000_000 * 1024),
    # cgroup v1: limit_in_bytes less usage_in_bytes; no limit is a huge number
    (None, {"memory.limit_in_bytes": "6000000000", "memory.usage_in_bytes": "1000000000"},
     5_000_000_000),
    (None, {"memory.limit_in_bytes": "9223372036854771712",
            "memory.usage_in_bytes": "1000000000"}, 20_000_000 * 1024),
])
def test_available_memory_is_the_least_of_host_and_cgroup(tmp_path, v2, v1, expected,
                                                          monkeypatch):
    monkeypatch.setattr(tb, "_rlimit_headroom", lambda: None)
    root, meminfo, proc = _cgroup_files(tmp_path, v2, v1,
                                        "0::/my.slice\n" if v2 else "4:memory:/job\n")
    assert tb.available_bytes("cpu", root, meminfo, proc) == expected


def test_available_memory_heeds_the_data_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (_vm("VmData") + 2**30, hard))
        assert 0.9 * 2**30 < (tb._rlimit_headroom() or 0) <= 2**30
        assert tb.available_bytes("cpu") <= 2**30
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.parametrize("overrides, dynamic", [
    ([], False),  # CPU: the padded forward, rows cut by count
    (["actor_rollout_ref.actor.fsdp_config.use_remove_padding=true"], True),
    (["actor_rollout_ref.actor.fsdp_config.use_remove_padding=true", "trainer.ranks=2",
      "algorithm.rollout_correction.bypass_mode=true",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"], False),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true"], True),
])
def test_use_dynamic_bsz_auto(overrides, dynamic):
    from workers.trainer.engine_config import dynamic_bsz

    assert dynamic_bsz(load_config(None, overrides), "cpu") is dynamic

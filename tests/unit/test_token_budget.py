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

SMOLLM2 = REPO_ROOT / "var" / "models" / "smollm2-135m-instruct"


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0]) * 1024
    raise KeyError(key)


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


def test_the_auto_budget_sets_the_step_s_own_growth_aside():
    params = 100_000_000
    growth = 8 * params + 12 * params
    assert tb.auto_budget(30 * 10**9, params, params, 1, 1) == (30 * 10**9 - growth) // 2
    # two ranks on one host share its memory; each holds half the optimizer state
    assert tb.auto_budget(30 * 10**9, params, params, 2, 2) == \
        int(0.5 * (30 * 10**9 - 8 * params - 6 * params) / 2)
    assert tb.auto_budget(10**9, params, params, 1, 1) == 0
    assert tb.max_token_len(0, 1000) == 1  # a row longer than the bound runs alone


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

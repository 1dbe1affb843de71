"""``bench.update_dtype`` compares fp32 and bf16 compute at the same micro-batches: its token
bound is pinned, not derived from the memory free when each engine is built."""

from __future__ import annotations

import pytest

from bench import update_dtype
from workers.trainer.engine_config import engine_spec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_token_bound_is_pinned_for_both_dtypes(dtype):
    spec = engine_spec(update_dtype.bench_config(dtype, 1), str(update_dtype.MODEL), 0)
    assert spec.max_token_len_per_gpu == update_dtype.TOKEN_BOUND == 65536
    assert spec.micro_batch_memory_gb is None  # not read: the bound is given
    assert spec.compute_dtype == dtype

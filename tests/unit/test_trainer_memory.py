"""An update of long rows stays within the memory the trainer may use: micro-batches are
bounded by tokens by default (``ppo_max_token_len_per_gpu: auto``), the bound derived from
the memory left, here an RLIMIT_DATA."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

from app.config import load_config
from app.config.loader import REPO_ROOT
from workers.trainer.token_budget import proc_kb

TINY = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")
LIMIT_MB = 512
ROWS, ROW_TOKENS = 64, 500


def _vm(key: str) -> int:
    return proc_kb(Path("/proc/self/status"), [key])[key]


def _child(limit_mb: int) -> None:
    """One update of ROWS x ROW_TOKENS tokens under an RLIMIT_DATA of ``limit_mb`` above
    what the built engine holds; prints what it took as JSON."""
    import random

    from workers.trainer.batch import Sample
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    cfg = load_config(None, ["trainer.device=cpu", "trainer.cpu_threads=1"])
    # RLIMIT_DATA counts address space that the first engine of a process reserves once
    # (threads, allocator arenas, modules imported on first use): the limit is set after a
    # first build, so that it bounds what the second engine and its update take
    EngineTrainer(cfg, TINY).close()
    resource.setrlimit(resource.RLIMIT_DATA,
                       (_vm("VmData") + limit_mb * 2**20, resource.RLIM_INFINITY))
    trainer = EngineTrainer(cfg, TINY)
    rng = random.Random(0)
    samples = []
    for i in range(ROWS):
        resp = [rng.randint(3, 26) for _ in range(32)]
        samples.append(Sample([1] + [rng.randint(3, 26) for _ in range(ROW_TOKENS - 33)], resp,
                              [-3.0] * len(resp), float(i % 2), f"g{i // 4}", 1.0, 0, f"r{i}"))
    batch = to_verl_batch(samples, trainer.pad_id)
    # the peak is measured from here: the first engine's build may have peaked higher (and
    # the process's lifetime peak, ru_maxrss, with it) than the update does. Writing 5 to
    # clear_refs sets the high-water mark VmHWM back to the resident size now.
    Path("/proc/self/clear_refs").write_text("5")
    rss = _vm("VmRSS")
    metrics = trainer.update(batch, 0)
    peak = _vm("VmHWM")
    print(json.dumps({"grad_norm": metrics["actor/grad_norm"], "peak_growth": peak - rss,
                      "max_token_len": getattr(trainer, "max_token_len", None)}))


def test_an_update_of_long_rows_stays_within_the_memory_limit():
    """64 rows of 500 tokens: in one micro-batch the update takes about 1.3 GB and, under a
    512 MB limit, fails to allocate; the default bound cuts it into micro-batches that fit
    (about 5,000 tokens each) and the update completes."""
    out = subprocess.run(
        [sys.executable, "-c",
         f"from tests.unit.test_trainer_memory import _child; _child({LIMIT_MB})"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert math.isfinite(got["grad_norm"]) and got["grad_norm"] > 0
    assert got["peak_growth"] < LIMIT_MB * 2**20
    # the bound came from the limit: at most half of it over the tiny model's 46,512 bytes
    # a token, and far less than the batch
    assert 1000 < got["max_token_len"] < 0.5 * LIMIT_MB * 2**20 / 46512 < ROWS * ROW_TOKENS

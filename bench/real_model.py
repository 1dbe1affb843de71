"""The real model's costs, measured in one run: SmolLM2-135M-Instruct on this machine.

- the update on verl's FSDP2 engine (old log-probs, then forward + backward + AdamW) on a
  batch shaped like the arithmetic example's (two-turn rows of about ``--prompt`` + 2 x
  ``--response`` tokens), its trained tokens/s, and its FLOP/s by 2ND + 6ND against this
  machine's fp32 matmul rate measured in the same minute;
- the weight-sync cycle into the real vLLM server (bf16 export, reload + prefix-cache reset,
  probe), in seconds;
- vLLM's generation tokens/s for the example's chat calls at its concurrency;
- peak resident memory of the trainer (this process) and of the server.

Usage: python -m bench.real_model [--rows 32] [--concurrency 64] [--cycles 3]  (prints JSON)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "var" / "models" / "smollm2-135m-instruct"
NAME = "smollm2-135m-instruct"


def matmul_gflops(seconds: float = 3.0, n: int = 2048) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    return 2 * n ** 3 * done / (time.perf_counter() - start) / 1e9


def tree_rss_bytes(pid: int) -> int:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def generation(url: str, calls: int, concurrency: int, max_tokens: int, api_key: str
               ) -> dict[str, float]:
    import requests

    from examples.arith.agent import question

    def one(i: int) -> int:
        body = {"model": NAME, "max_tokens": max_tokens, "temperature": 1.0,
                "messages": [{"role": "user", "content": question(i % 10, (3 * i) % 10)}]}
        return requests.post(url + "/v1/chat/completions", json=body, timeout=600,
                             headers={"Authorization": f"Bearer {api_key}"},
                             ).json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(calls)))
    seconds = time.perf_counter() - start
    return {"calls": calls, "concurrency": concurrency, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def batch(rows: int, prompt: int, response: int, groups_of: int = 8):
    """Two-turn rows: prompt, an answer, the next user turn, a second answer."""
    from workers.trainer.batch import Sample

    rng = random.Random(0)
    samples = []
    for r in range(rows):
        first = [rng.randrange(100, 40000) for _ in range(prompt)]
        a1 = [rng.randrange(100, 40000) for _ in range(response)]
        turn = [rng.randrange(100, 40000) for _ in range(20)]
        a2 = [rng.randrange(100, 40000) for _ in range(response)]
        gid, rid, reward = f"g{r // groups_of}", f"r{r}", float(r % 2)
        samples.append(Sample(first, a1, [-2.0] * response, reward, gid, 1.0, 0, rid))
        samples.append(Sample(first + a1 + turn, a2, [-2.0] * response, reward, gid, 1.0, 0,
                              rid))
    return samples


def main(argv: list[str] | None = None) -> int:
    from bench.stack import bench_dir

    with bench_dir() as tmp:
        return run(argv, tmp)


def run(argv: list[str] | None, tmp: Path) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="rollouts (rows) per update")
    ap.add_argument("--prompt", type=int, default=45, help="first prompt tokens")
    ap.add_argument("--response", type=int, default=12, help="tokens per answer")
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=3, help="weight-sync cycles")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--threads", type=int, default=0, help="trainer.cpu_threads (0: all)")
    args = ap.parse_args(argv)
    if not (MODEL / "carryover-build.json").exists():
        raise SystemExit(f"{MODEL} is missing: run scripts/setup.sh")

    from bench.stack import free_port, inference_server

    port = free_port()
    os.environ.setdefault("WANDB_MODE", "disabled")
    from app.config import load_config
    from app.config.secrets import inference_api_key
    from workers.trainer import weights
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    cfg = load_config(str(REPO / "config" / "arith.yaml"), [
        "trainer.device=cpu", f"inference.port={port}",
        f"inference.urls=[http://127.0.0.1:{port}]",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        # every core, as the matmul rate it is compared with (the example gives the update
        # one core, the engine the other)
        f"trainer.cpu_threads={args.threads}"])
    weights.use_api_key(inference_api_key(cfg))
    built = json.loads((MODEL / "carryover-build.json").read_text())
    out: dict = {"model": NAME, "parameters": int(built["parameters"]),
                 "inference_dtype": str(cfg.inference.dtype)}
    out["matmul_fp32_gflops"] = matmul_gflops()
    out["cpu_threads"] = args.threads or os.cpu_count()

    trainer = EngineTrainer(cfg, str(MODEL))
    samples = batch(args.rows, args.prompt, args.response)
    vb = to_verl_batch(samples, trainer.pad_id)
    # real tokens per row (prompt and response, padding excluded): what a forward computes on
    seq_tokens = int(vb.prompt_mask.sum() + vb.response_attention.sum())
    times = []
    for step in range(args.updates):
        t = time.perf_counter()
        trainer.update(vb, step)
        times.append(time.perf_counter() - t)
    best = min(times)
    flops = 8 * out["parameters"] * seq_tokens / best  # 2ND old log-probs + 6ND training
    out["update"] = {"rows": len(vb), "sequence_tokens": seq_tokens, "seconds": times,
                     "tokens_per_s": seq_tokens / best, "gflops": flops / 1e9,
                     "fraction_of_matmul": flops / 1e9 / out["matmul_fp32_gflops"],
                     "micro_batch": args.micro}
    out["matmul_fp32_gflops_after"] = matmul_gflops()

    ids = weights.probe_ids(MODEL)
    with inference_server(cfg, tmp / "vllm.log") as (url, proc):
        out["generation"] = generation(url, args.calls, args.concurrency, args.response,
                                       inference_api_key(cfg))
        cycles = []
        previous = trainer.probe_log_probs(ids)
        for version in range(1, args.cycles + 1):
            trainer.update(vb, args.updates + version)
            expected = trainer.probe_log_probs(ids)
            t0 = time.perf_counter()
            path = weights.publish_version(tmp / "weights", version, 2,
                                           lambda d: trainer.export_weights(d, "bfloat16"))
            t1 = time.perf_counter()
            weights.reload_weights(url, path)
            t2 = time.perf_counter()
            gap = weights.verify_sync(url, NAME, expected, previous,
                                      float(cfg.trainer.probe_tolerance), ids)
            t3 = time.perf_counter()
            previous = expected
            cycles.append({"export_s": t1 - t0, "reload_s": t2 - t1, "probe_s": t3 - t2,
                           "total_s": t3 - t0, **gap,
                           "bytes": (path / "model.safetensors").stat().st_size})
        out["weight_sync"] = cycles
        out["server_rss_bytes"] = tree_rss_bytes(proc.pid)
    out["trainer_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

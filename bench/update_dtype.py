"""The real model's update in fp32 and in bf16 compute, side by side, and its thread settings.

SmolLM2-135M-Instruct on verl's FSDP2 engine, master weights and AdamW state in fp32 in both
(``fsdp_config.param_dtype`` only sets the compute dtype). For each setting, in a process of
its own, in the order given (alternating, so a slow minute hits both):

- **speed**: the update (old log-probs, then forward + backward + AdamW) on a batch shaped
  like the long-running agent's (two-turn rows, ``bench.real_model.batch``): seconds and
  trained tokens/s (the best of ``--updates`` after the first). The micro-batches' token
  bound is pinned (``TOKEN_BOUND``, reported as ``max_token_len_per_gpu``): ``auto`` derives
  it from the memory free at the engine's build, so with little free memory the two dtypes
  could run different micro-batches and the comparison would measure that instead;
- **the probe gap**: the teacher-forced probe's log-probs computed by this engine against the
  same weights computed in fp32 (mean absolute difference, nats per token): what the weight
  sync's probe sees on top of the served dtype's own gap;
- **learning**: ``--learn`` updates on real arithmetic rows (the chat-templated question,
  right answers rewarded 1 and restatements 0, each sampled log-prob taken from the engine
  itself so importance weights start at 1), and how far the right answers' mean log-prob
  rose and the wrong ones' fell. Both dtypes start from the same weights and batch.

Run it with nothing else on the machine.

Usage: python -m bench.update_dtype [--settings float32:1,bfloat16:1,float32:2,bfloat16:2]
       [--rows 32] [--updates 3] [--learn 4]   (prints JSON, then a table on stderr)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "var" / "models" / "smollm2-135m-instruct"
# ppo_max_token_len_per_gpu for every setting: above any batch here, so the micro-batches are
# ppo_micro_batch_size_per_gpu's rows whatever the memory free
TOKEN_BOUND = 65536


def arith_rows(tokenizer: Any, count: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Chat-templated sums, each answered right ("7") or by restating it ("3 + 4 = 9")."""
    from examples.arith.agent import question

    prompts, answers, rewards = [], [], []
    for i in range(count):
        a, b = i % 10, (3 * i + 1) % 10
        msgs = [{"role": "user", "content": question(a, b)}]
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        right = i % 2 == 0
        text = f"{a + b}" if right else f"{a} + {b} = {a + b + 1}"
        answers.append(tokenizer.encode(text, add_special_tokens=False) + [2])  # <|im_end|>
        prompts.append(list(prompt))
        rewards.append(1.0 if right else 0.0)
    return prompts, answers, rewards


def bench_config(dtype: str, threads: int) -> Any:
    """The long-running agent's configuration on the CPU, in compute ``dtype`` on
    ``threads`` threads, with the token bound pinned."""
    from app.config import load_config

    return load_config(str(REPO / "config" / "long-agent.yaml"), [
        "trainer.device=cpu", f"trainer.cpu_threads={threads}",
        f"actor_rollout_ref.actor.fsdp_config.param_dtype={dtype}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BOUND}"])


def one(dtype: str, threads: int, rows: int, updates: int, learn: int) -> dict[str, Any]:
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch
    from transformers import AutoTokenizer

    from bench.real_model import batch
    from workers.trainer import weights
    from workers.trainer.batch import Sample
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    torch.manual_seed(0)
    cfg = bench_config(dtype, threads)
    trainer = EngineTrainer(cfg, str(MODEL))
    out: dict[str, Any] = {"param_dtype": dtype, "cpu_threads": threads,
                           "max_token_len_per_gpu": trainer.max_token_len}

    # the probe gap: this engine's probe log-probs against fp32 maths on the same weights
    ids = weights.probe_ids(MODEL)
    mine = trainer.probe_log_probs(ids)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(MODEL), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, :-1].float()
    fp32 = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    tail = fp32[-len(mine):] if len(mine) <= len(fp32) else fp32
    out["probe_gap_vs_fp32"] = float((torch.tensor(mine[-len(tail):]) - tail).abs().mean())
    del ref

    vb = to_verl_batch(batch(rows, 45, 12), trainer.pad_id)
    tokens = int(vb.prompt_mask.sum() + vb.response_attention.sum())
    times = []
    for step in range(updates):
        t = time.perf_counter()
        trainer.update(vb, step)
        times.append(time.perf_counter() - t)
    best = min(times[1:] or times)
    out.update({"rows": len(vb), "sequence_tokens": tokens, "update_seconds": times,
                "tokens_per_s": tokens / best})

    if learn:
        # a fresh engine: learning is measured from the shipped weights
        trainer.close()
        trainer = EngineTrainer(cfg, str(MODEL))
        tok = AutoTokenizer.from_pretrained(str(MODEL))
        prompts, answers, rewards = arith_rows(tok, 32)
        samples = [Sample(p, a, [0.0] * len(a), r, f"g{i // 8}", 1.0, 0, f"r{i}")
                   for i, (p, a, r) in enumerate(zip(prompts, answers, rewards, strict=True))]
        vb = to_verl_batch(samples, trainer.pad_id)
        start = trainer.log_probs(vb)
        from dataclasses import replace

        vb = replace(vb, rollout_log_probs=start.clone())
        mask = vb.response_mask
        right = torch.tensor(rewards) > 0.5

        def mean_lp(lp: torch.Tensor, rows: torch.Tensor) -> float:
            return float((lp[rows] * mask[rows]).sum() / mask[rows].sum())

        curve = []
        for step in range(learn):
            trainer.update(vb, step)
            lp = trainer.log_probs(vb)
            curve.append({"right": mean_lp(lp, right) - mean_lp(start, right),
                          "wrong": mean_lp(lp, ~right) - mean_lp(start, ~right)})
        out["learning_log_prob_change"] = curve
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="float32:1,bfloat16:1,float32:2,bfloat16:2",
                    help="dtype:threads, comma-separated, run in this order")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--learn", type=int, default=4, help="learning updates (first of each dtype)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (MODEL / "carryover-build.json").exists():
        raise SystemExit(f"{MODEL} is missing: run scripts/setup.sh")
    if args.one:
        dtype, threads = args.one.split(":")
        print(json.dumps(one(dtype, int(threads), args.rows, args.updates, args.learn)))
        return 0
    results, learned = [], set()
    for setting in args.settings.split(","):
        dtype = setting.split(":")[0]
        learn = 0 if dtype in learned else args.learn
        learned.add(dtype)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.update_dtype", "--one", setting, "--rows",
             str(args.rows), "--updates", str(args.updates), "--learn", str(learn)],
            cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{setting}: {results[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr,
              flush=True)
    print(json.dumps({"model": MODEL.name, "results": results}, indent=1))
    print(f"{'compute':>10} {'threads':>8} {'update s':>9} {'tokens/s':>9} {'probe gap':>10}",
          file=sys.stderr)
    for r in results:
        best = min(r["update_seconds"][1:] or r["update_seconds"])
        print(f"{r['param_dtype']:>10} {r['cpu_threads']:>8} {best:>9.1f} "
              f"{r['tokens_per_s']:>9.0f} {r['probe_gap_vs_fp32']:>10.2e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

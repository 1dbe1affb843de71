"""A prepared GPU check of the update on verl's FSDP2 engine, through the trainer's own path.

Builds a Qwen2.5-0.5B-shaped model (random weights, tied embeddings, saved in bf16) locally,
then runs ``--steps`` PPO updates through ``EngineTrainer`` in bf16 compute with fp32 master
weights, micro-batches and gradient checkpointing, on synthetic groups whose rollout
log-probs are the engine's own (so the importance weights start near 1). Prints JSON: trained
tokens/s, peak accelerator memory, the log-prob gap between the engine and a plain Hugging
Face forward of the same weights, and the skipped (non-finite) steps.

Nothing is downloaded. ``--tiny`` is the CPU-sized variant CI runs (same code path).

Usage: python -m bench.gpu_trainer [--tiny] [--steps 5] [--groups 16] [--n 4]
       [--prompt-len 256] [--response-len 256] [--micro 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1000000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
            rope_theta=10000.0)


def build_model(out: Path, shape: dict, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, rms_norm_eps=1e-6, torch_dtype="bfloat16", **shape)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (CI)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--out", default=None, help="where the model is built (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.groups, args.n, args.prompt_len, args.response_len = 4, 4, 24, 16

    import torch

    from app.config import load_config
    from bench.reference import token_log_probs
    from workers.trainer.batch import Sample, to_batch
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    shape = TINY if args.tiny else QWEN25_05B
    out = Path(args.out or tempfile.mkdtemp(prefix="carryover-gpu-")) / "qwen2.5-shaped"
    t = time.monotonic()
    if not (out / "config.json").exists():
        build_model(out, shape)
    build_s = time.monotonic() - t

    cfg = load_config(None, [
        f"trainer.device={device}", "actor_rollout_ref.actor.lr=1e-6",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        "actor_rollout_ref.actor.enable_gradient_checkpointing=true",
        f"trainer.total_steps={args.steps}"])
    t = time.monotonic()
    trainer = EngineTrainer(cfg, str(out))
    engine_build_s = time.monotonic() - t

    rng = random.Random(0)
    vocab = shape["vocab_size"]
    samples = []
    for g in range(args.groups):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)]
        for _ in range(args.n):
            resp = [rng.randrange(3, vocab) for _ in range(args.response_len)]
            samples.append(Sample(prompt, resp, [0.0] * len(resp), rng.random(), f"g{g}",
                                  1.0, 0))
    vb = to_verl_batch(samples, trainer.pad_id)
    engine_lp = trainer.log_probs(vb)
    for i, s in enumerate(samples):  # behaviour log-probs = the engine's: on-policy
        s.rollout_logprobs = engine_lp[i][: len(s.response_ids)].tolist()
    vb = to_verl_batch(samples, trainer.pad_id)

    # The engine's forward against a plain Hugging Face forward of the same (initial) weights,
    # in fp32: what bf16 compute costs in log-prob accuracy.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        plain = torch.cat([token_log_probs(hf, to_batch(samples[i:i + 8], 0, device))[0].cpu()
                           for i in range(0, len(samples), 8)])
    n_params = sum(p.numel() for p in hf.parameters())
    del hf
    mask = vb.response_mask > 0
    gap = (engine_lp[mask] - plain[:, : engine_lp.shape[1]][mask]).abs()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, skipped = [], 0.0
    tokens = float(vb.response_mask.sum())
    for step in range(args.steps):
        t = time.monotonic()
        m = trainer.update(vb, step)
        times.append(time.monotonic() - t)
        skipped += m["actor/skipped_steps"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    timed = times[1:] or times  # the first update pays for warm-up
    master = trainer.ranks.call("master_dtype")[0]
    trainer.close()

    result = {
        "benchmark": "gpu_trainer", "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "model": "tiny" if args.tiny else "qwen2.5-0.5b-shaped (random weights, tied)",
        "parameters": n_params,
        "rows": len(vb), "trained_tokens_per_update": tokens, "steps": args.steps,
        "micro_batch_size_per_gpu": args.micro, "gradient_checkpointing": True,
        "compute_dtype": "bfloat16", "master_dtype": master,
        "update_seconds": times,
        "trained_tokens_per_s": tokens / statistics.median(timed),
        "peak_memory_gib": peak,
        "logprob_gap_engine_vs_hf": {"mean": float(gap.mean()), "max": float(gap.max())},
        "skipped_steps": skipped,
        "build_model_s": build_s, "build_engine_s": engine_build_s,
        "verl_platform": os.environ.get("VERL_PLATFORM", "auto"),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

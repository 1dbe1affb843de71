"""Offline learning check for the demo task: the trainer's own update on samples drawn with
Hugging Face ``generate`` (no services), to choose the demo's settings quickly.

It plays the demo agent's turns with the same chat template, tokenizer, reward and update
code as the real run, synchronously (no staleness, no rollout correction effects beyond
numerical ones). Prints one JSON line per step and a summary.

Usage: python scripts/tune_demo.py --steps 80 [key=value overrides of config/demo.yaml]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from app.config import load_config
    from app.driver.dataset import load_samples
    from bench.reference import PolicyTrainer, token_log_probs
    from examples.reverse.agent import ask, score
    from workers.trainer.batch import Sample, to_batch

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stale", type=int, default=0,
                    help="sample with the weights of this many updates ago (the live async "
                         "demo trains on samples one version old)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(REPO / "config/demo.yaml", args.overrides)
    model_path = str(REPO / cfg.actor_rollout_ref.model.path)
    tok = AutoTokenizer.from_pretrained(model_path)
    trainer = PolicyTrainer(cfg, model_path)
    rows = load_samples(str(REPO / cfg.data.train_files))
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    turns = args.turns or int(cfg.agent.get("turns", 2))
    ro = cfg.actor_rollout_ref.rollout
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    groups, n = int(cfg.data.train_batch_size), int(ro.n)
    first, rewards_by_step = [], []
    sampler = copy.deepcopy(trainer.model) if args.stale else trainer.model
    snapshots: deque = deque(maxlen=args.stale + 1)
    t0 = time.time()
    for step in range(args.steps):
        picks = [rng.choice(rows) for _ in range(groups)]
        convs = [[{"role": "user", "content": ask(p["text"], 0)}]
                 for p in picks for _ in range(n)]
        scores: list[list[float]] = [[] for _ in convs]
        calls: list[list[tuple[list[int], list[int]]]] = [[] for _ in convs]
        if args.stale:
            snapshots.append({k: v.detach().clone() for k, v in
                              trainer.model.state_dict().items()})
            sampler.load_state_dict(snapshots[0])
        sampler.eval()
        for turn in range(turns):
            prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=False) for c in convs]
            prompts = [p["input_ids"] if isinstance(p, dict) else list(p) for p in prompts]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                out = sampler.generate(
                    input_ids=ids, attention_mask=att, do_sample=True,
                    temperature=float(ro.temperature), top_k=0, top_p=1.0,
                    max_new_tokens=int(ro.max_tokens), eos_token_id=eos, pad_token_id=0)
            for i, p in enumerate(prompts):
                resp = out[i, width:].tolist()
                if eos in resp:
                    resp = resp[:resp.index(eos) + 1]
                stopped = resp[-1:] == [eos]
                text = tok.decode(resp, skip_special_tokens=True)
                scores[i].append(score(text, picks[i // n]["target"]) if stopped else 0.0)
                calls[i].append((p, resp))
                convs[i] = convs[i] + [{"role": "assistant", "content": text},
                                       {"role": "user",
                                        "content": ask(picks[i // n]["text"], turn + 1)}]
        trainer.model.train()
        samples = []
        for i, cs in enumerate(calls):
            reward = sum(scores[i]) / len(scores[i])
            for p, r in cs:
                samples.append(Sample(p, r, [0.0] * len(r), reward, f"g{i // n}",
                                      float(ro.temperature), 0, f"r{i}"))
        batch = to_batch(samples, trainer.pad_id)
        with torch.no_grad():
            batch.rollout_log_probs = token_log_probs(sampler, batch)[0].detach()
        metrics = trainer.update(batch, step)
        mean = sum(sum(s) / len(s) for s in scores) / len(scores)
        rewards_by_step.append(mean)
        if step < 2:
            first.append(mean)
        print(json.dumps({"step": step, "reward": round(mean, 4),
                          "len": round(metrics["actor/response_length_mean"], 2),
                          "entropy": round(metrics.get("actor/entropy", float("nan")), 3),
                          "s": round(time.time() - t0, 1)}), flush=True)
    last = rewards_by_step[-5:]
    print(json.dumps({"first2": sum(first) / len(first), "last5": sum(last) / len(last),
                      "gain": sum(last) / len(last) - sum(first) / len(first),
                      "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

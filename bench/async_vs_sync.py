"""Asynchronous vs synchronous training throughput, against the ideal, on the real stack.

Starts its own Redis, vLLM CPU server, gateway, Celery workers (a fixed number of rollout
slots) and the real trainer, then trains the tiny model with agents that make one real model
call and then sleep for a duration drawn from a distribution (``bench/agents.py``: fixed, or
log-normal with each sigma). For every distribution it runs sync and async at each
``async_train_batch_size`` ratio, interleaved, same seed (the n-th group gets the same
durations in every mode). Per mode: optimizer steps per minute, rollouts per second,
worker-slot utilisation, trainer idle fraction, carry-over age, drain seconds, and the
fraction of the ideal:

    ideal step time = train_batch_size * n * mean rollout seconds / slots + update seconds

(the slots busy all the time on exactly the rollouts one update needs, plus the update),
with the mean rollout and the update time measured in the sync run of the same workload.
Short async runs can beat it: they train the groups that finish first and carry the slow
ones, whose age the carry-over columns show.

Usage: python -m bench.async_vs_sync [--sigmas 0.5,1.0,1.5] [--ratios 1.5,2,3] [--steps 6]
       [--slots 16] [--tbs 4] [--n 4] [--median-s 2.0] [--out var/bench]
Prints JSON, then a markdown table; writes a PNG of throughput vs async_train_batch_size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROLES = ["redis", "inference", "gateway", "groups", "rollout", "trainer"]


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_mode(base: list[str], data: Path, tmp: Path, dist: str, sigma: float, ratio: float | None,
             args: argparse.Namespace) -> dict[str, Any]:
    """One training run; ``ratio`` None = sync."""
    from app.config import load_config
    from app.driver.loop import train
    from app.state import keys
    from app.state.connection import connect, resolve_redis_url
    from app.state.records import SiblingResult

    mode = "sync" if ratio is None else f"async x{ratio:g}"
    atbs = max(args.tbs + 1, round(args.tbs * ratio)) if ratio else 2 * args.tbs
    cfg = load_config(None, [
        *base, f"data.train_files={data}", f"data.train_batch_size={args.tbs}",
        f"actor_rollout_ref.rollout.n={args.n}", f"trainer.total_steps={args.steps}",
        f"agentlightning.async_rollout.enabled={'true' if ratio else 'false'}",
        f"agentlightning.async_rollout.async_train_batch_size={atbs}",
        "controller.agent=bench.agents:timed",
        f"agent.dist={dist}", f"agent.sigma={sigma}", f"agent.median_s={args.median_s}",
        f"agent.seed={args.seed}", f"logging.dir={tmp / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp / 'weights'}",
        f"trainer.checkpoint_dir={tmp / 'checkpoints'}", f"trainer.save_freq={args.steps}"])
    rows: list[dict] = []
    marks: list[float] = []

    def on_step(step: int, metrics: dict) -> None:
        rows.append(metrics)
        marks.append(time.time())

    start = time.time()
    summary = train(cfg, on_step=on_step)
    client = connect(resolve_redis_url(cfg))
    # The first step includes start-up (first dispatch, engine warm-up): measure after it.
    t0, t1 = marks[0], marks[-1]
    wall = t1 - t0
    timed_rows = rows[1:]
    steps = len(timed_rows)
    busy = 0.0
    durations: list[float] = []
    seq = 0
    while True:
        gid = f"{summary['run_id']}-g{seq}"
        results = client.hvals(keys.group_results(gid))
        if not results and not client.exists(keys.group(gid)):
            break
        for raw in results:
            r = SiblingResult.from_json(raw)
            if r.status != "ok":
                continue
            durations.append(r.seconds)
            begun = r.finished_at - r.seconds
            busy += max(0.0, min(r.finished_at, t1) - max(begun, t0))
        seq += 1
    trainer_s = sum(r["timing/update_seconds"] for r in timed_rows)
    carry_age = [r.get("training/async/consumed_age_mean_steps", 0.0) for r in timed_rows]
    carry_max = [r.get("training/async/consumed_age_max_steps", 0) for r in timed_rows]
    return {
        "mode": mode, "dist": dist, "sigma": sigma if dist != "fixed" else 0.0,
        "ratio": ratio or 1.0, "async_train_batch_size": atbs if ratio else args.tbs,
        "steps_timed": steps, "wall_s": wall, "total_wall_s": time.time() - start,
        "steps_per_min": 60.0 * steps / wall if wall > 0 else 0.0,
        "rollouts_per_s": steps * args.tbs * args.n / wall if wall > 0 else 0.0,
        "slot_utilisation": busy / (args.slots * wall) if wall > 0 else 0.0,
        "trainer_idle_fraction": 1.0 - trainer_s / wall if wall > 0 else 0.0,
        "carry_over_age_mean": statistics.fmean(carry_age) if carry_age else 0.0,
        "carry_over_age_max": max(carry_max) if carry_max else 0,
        "drain_s_mean": statistics.fmean(
            r["training/async/proxy_drain_seconds"] for r in timed_rows) if steps else 0.0,
        "update_s_mean": statistics.fmean(
            r["timing/trainer_update_seconds"] for r in timed_rows) if steps else 0.0,
        "rollout_s_mean": statistics.fmean(durations) if durations else 0.0,
    }


def plot(results: list[dict], ideals: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, ideal) in enumerate(ideals.items()):
        pts = sorted((r["ratio"], r["steps_per_min"]) for r in results if r["label"] == label)
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        ax.axhline(ideal, color=color, ls="--", lw=1)
    ax.set_xlabel("async_train_batch_size / train_batch_size (1 = sync)")
    ax.set_ylabel("optimizer steps per minute")
    ax.set_title("Throughput vs groups in flight (dashed: ideal)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sigmas", default="0.5,1.0,1.5")
    ap.add_argument("--no-fixed", action="store_true", help="skip the fixed-duration control")
    ap.add_argument("--ratios", default="1.5,2,3")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tbs", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--median-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "var" / "bench"))
    args = ap.parse_args(argv)

    from bench.stack import bench_stack

    dists = ([] if args.no_fixed else [("fixed", 0.0)]) + [
        ("lognormal", s) for s in parse_floats(args.sigmas)]
    ratios: list[float | None] = [None, *parse_floats(args.ratios)]
    results: list[dict] = []
    with bench_stack(ROLES, f"services.rollout_concurrency={args.slots}") as (base, tmp):
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"text": t, "target": t[::-1]}) + "\n"
                                for t in ("abc", "bad", "cab", "dab", "bcd", "dca", "acd", "bba")))
        for dist, sigma in dists:
            label = "fixed" if dist == "fixed" else f"lognormal sigma {sigma:g}"
            for ratio in ratios:  # interleaved: every mode of one workload back to back
                r = run_mode(base, data, tmp, dist, sigma, ratio, args)
                r["label"] = label
                results.append(r)
                print(f"# {label:22s} {r['mode']:10s} {r['steps_per_min']:.1f} steps/min",
                      file=sys.stderr, flush=True)

    ideals: dict[str, float] = {}
    for label in dict.fromkeys(r["label"] for r in results):
        mine = [r for r in results if r["label"] == label]
        sync = next(r for r in mine if r["mode"] == "sync")
        # The workload's own figures come from the sync run: it waits for every rollout (an
        # unbiased mean; async runs train the fast ones first) and updates on an idle CPU.
        step_s = args.tbs * args.n * sync["rollout_s_mean"] / args.slots + sync["update_s_mean"]
        ideals[label] = 60.0 / step_s
        for r in mine:
            r["ideal_steps_per_min"] = ideals[label]
            r["fraction_of_ideal"] = r["steps_per_min"] / ideals[label]
            r["speedup_vs_sync"] = (r["steps_per_min"] / sync["steps_per_min"]
                                    if sync["steps_per_min"] else math.nan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "async_vs_sync.png"
    plot(results, ideals, png)
    summary = {
        "benchmark": "async_vs_sync", "machine": f"{os.cpu_count()} CPUs",
        "trainer": "real (verl PPO update on the tiny model, weight sync to vLLM)",
        "slots": args.slots, "train_batch_size": args.tbs, "n": args.n,
        "steps_per_run": args.steps, "median_rollout_s": args.median_s, "seed": args.seed,
        "ideal_formula": "60 / (train_batch_size * n * mean_rollout_s / slots + update_s), "
                         "both measured in the sync run",
        "plot": str(png), "results": results,
    }
    print(json.dumps(summary, indent=1))
    print("\n| workload | mode | steps/min | rollouts/s | slot util | trainer idle | "
          "carry age mean/max | drain s | ideal steps/min | of ideal | vs sync |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['label']} | {r['mode']} | {r['steps_per_min']:.1f} | "
              f"{r['rollouts_per_s']:.2f} | {r['slot_utilisation']:.0%} | "
              f"{r['trainer_idle_fraction']:.0%} | {r['carry_over_age_mean']:.2f}/"
              f"{r['carry_over_age_max']} | {r['drain_s_mean']:.3f} | "
              f"{r['ideal_steps_per_min']:.1f} | {r['fraction_of_ideal']:.0%} | "
              f"{r['speedup_vs_sync']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

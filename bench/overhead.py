"""Orchestration overhead per rollout, with instant agents (no model call, no wait).

Starts Redis and the rollout and groups Celery workers, then runs the driver's collection
loop (``bench/collect_only.py``: the same Collector calls as a training run, no update) on
agents that return at once. What is measured is what this system adds around an agent:

- per group: chord dispatch to group selected, p50/p99 (queueing, the sibling tasks, the
  chord callback, the doorbell, the selection transaction);
- Redis commands per rollout (every client: driver, workers, Celery's broker and result
  backend), from the server's own ``INFO commandstats``;
- Celery tasks per second sustained (siblings plus chord callbacks, over the timed steps).

Usage: python -m bench.overhead [--steps 40] [--warmup 5] [--tbs 8] [--n 4] [--slots 16]
Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.collect_only import CollectRun
from bench.stack import bench_stack, percentile, redis_calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps not timed (start-up)")
    ap.add_argument("--tbs", type=int, default=8, help="train_batch_size (groups per step)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    args = ap.parse_args(argv)

    with bench_stack(["redis", "groups", "rollout"],
                     f"services.rollout_concurrency={args.slots}") as (base, tmp):
        from app.config import load_config
        from app.state.connection import connect, resolve_redis_url
        from bench.collect_only import collect, group_latencies

        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"text": f"p{i}"}) + "\n" for i in range(64)))
        cfg = load_config(None, [
            *base, f"data.train_files={data}", f"data.train_batch_size={args.tbs}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"agentlightning.async_rollout.async_train_batch_size={2 * args.tbs}",
            "controller.agent=bench.agents:instant", f"logging.dir={tmp / 'runs'}"])
        client = connect(resolve_redis_url(cfg))
        # Warm-up steps run first (worker start, imports); the counters start after them.
        collect(client, cfg, "overhead-warmup", args.warmup)
        calls0 = redis_calls(client)
        t0 = time.time()
        run = collect(client, cfg, "overhead", args.steps)
        wall = time.time() - t0
        calls = redis_calls(client) - calls0
        selected = [g for step in run.selected for g in step]
        lat = group_latencies(client, selected)
    return report(args, run, selected, lat, calls, wall)


def report(args: argparse.Namespace, run: CollectRun, selected: list[str],
           lat: dict[str, list[float]], calls: int, wall: float) -> int:
    rollouts = len(selected) * args.n
    tasks = len(selected) * (args.n + 1)
    d2s = [x * 1000 for x in lat["dispatch_to_selected"]]
    summary = {
        "benchmark": "overhead", "machine": f"{os.cpu_count()} CPUs",
        "agents": "instant (no model call)", "slots": args.slots,
        "train_batch_size": args.tbs, "n": args.n, "steps_timed": args.steps,
        "groups_selected": len(selected), "rollouts": rollouts, "wall_s": wall,
        "dispatch_to_selected_ms": {"p50": percentile(d2s, 0.5), "p99": percentile(d2s, 0.99),
                                    "mean": statistics.fmean(d2s) if d2s else 0.0},
        "redis_commands_per_rollout": calls / rollouts if rollouts else 0.0,
        "celery_tasks_per_s": tasks / wall if wall > 0 else 0.0,
        "rollouts_per_s": rollouts / wall if wall > 0 else 0.0,
        "driver_select_ms_per_step": 1000 * statistics.fmean(run.select_s),
        "driver_top_up_ms_per_step": 1000 * statistics.fmean(run.top_up_s),
    }
    print(json.dumps(summary, indent=1))
    print("\n| metric | value |\n|---|---|")
    print(f"| chord dispatch -> group selected p50 / p99 | "
          f"{summary['dispatch_to_selected_ms']['p50']:.1f} / "
          f"{summary['dispatch_to_selected_ms']['p99']:.1f} ms |")
    print(f"| Redis commands per rollout (all clients) | "
          f"{summary['redis_commands_per_rollout']:.1f} |")
    print(f"| Celery tasks per second, sustained | {summary['celery_tasks_per_s']:.0f} |")
    print(f"| rollouts per second | {summary['rollouts_per_s']:.0f} |")
    print(f"| driver per step: select / top-up | {summary['driver_select_ms_per_step']:.2f} / "
          f"{summary['driver_top_up_ms_per_step']:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

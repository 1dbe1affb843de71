"""Driver cost as the number of active groups grows (1,000 and 10,000 by default).

Starts Redis and the rollout and groups Celery workers (``threads`` pool, so a slot is a
thread and thousands are cheap), then for each size runs the driver's collection loop
(``bench/collect_only.py``) with ``async_train_batch_size`` = that size: the pool is filled,
and each step selects ``train_batch_size`` ready groups and dispatches as many new ones.
Agents make no model call; they sleep a log-normal duration (``bench.agents:sleeping``).

Per size: the fill time; driver bookkeeping per step (the selection transaction, and the
top-up that dispatches replacement chords), also per selected group; Redis memory per active
rollout (``used_memory`` after the fill minus before, over size x n: group records plus
Celery's queued messages); completion-to-selection and dispatch-to-selection latency (the
rollout queue is not consumed while the pool fills, so no backlog of unselected completions
builds up before the first step). The
claim under test: bookkeeping per selected group stays flat as the active set grows.

Usage: python -m bench.scale [--sizes 1000,10000] [--steps 20] [--tbs 32] [--n 2]
       [--slots 64] [--median-s 1.0]
Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.stack import bench_stack, percentile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tbs", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--median-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]

    results = []
    with bench_stack(["redis", "groups", "rollout"],
                     f"services.rollout_concurrency={args.slots}") as (base, tmp):
        from app.celery_app import celery_app
        from app.config import load_config
        from app.state.connection import connect, resolve_redis_url
        from bench.collect_only import group_latencies, run_steps, start_run

        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"text": f"p{i}"}) + "\n" for i in range(1000)))
        for size in sizes:
            cfg = load_config(None, [
                *base, f"data.train_files={data}", f"data.train_batch_size={args.tbs}",
                f"actor_rollout_ref.rollout.n={args.n}",
                f"agentlightning.async_rollout.async_train_batch_size={size}",
                "controller.agent=bench.agents:sleeping", f"agent.median_s={args.median_s}",
                f"logging.dir={tmp / 'runs'}"])
            client = connect(resolve_redis_url(cfg))
            mem0 = int(client.info("memory")["used_memory"])
            t0 = time.time()
            # Filling 10,000 groups takes a while; with the workers consuming meanwhile, the
            # completions would pile up unselected and the latencies would measure that
            # backlog. So the rollout queue is not consumed during the fill (Celery's own
            # remote control), which also makes the memory figure that of queued work.
            celery_app.control.cancel_consumer("rollout", reply=True)
            collector, run = start_run(client, cfg, f"scale-{size}")
            mem1 = int(client.info("memory")["used_memory"])
            celery_app.control.add_consumer("rollout", reply=True)
            run_steps(collector, run, args.steps)
            selected = [g for s in run.selected for g in s]
            lat = group_latencies(client, selected)
            c2s = [x * 1000 for x in lat["completed_to_selected"]]
            d2s = lat["dispatch_to_selected"]
            select_ms = [1000 * x for x in run.select_s]
            top_up_ms = [1000 * x for x in run.top_up_s]
            per_group = [(a + b) / max(len(s), 1) for a, b, s in
                         zip(select_ms, top_up_ms, run.selected, strict=True)]
            results.append({
                "active_groups": size, "active_rollouts": size * args.n,
                "fill_s": run.fill_s,
                "select_ms_per_step": statistics.median(select_ms),
                "top_up_ms_per_step": statistics.median(top_up_ms),
                "bookkeeping_ms_per_selected_group": statistics.median(per_group),
                "redis_bytes_per_active_rollout": (mem1 - mem0) / (size * args.n),
                "completed_to_selected_ms": {"p50": percentile(c2s, 0.5),
                                             "p99": percentile(c2s, 0.99)},
                "dispatch_to_selected_s": {"p50": percentile(d2s, 0.5),
                                           "p99": percentile(d2s, 0.99)},
                "wall_s": time.time() - t0,
            })
            print(f"# {size} active groups: "
                  f"{results[-1]['bookkeeping_ms_per_selected_group']:.2f} ms per selected "
                  f"group", file=sys.stderr, flush=True)
            # The next size starts clean: drop this run's queued work.
            celery_app.control.purge()

    first = results[0]["bookkeeping_ms_per_selected_group"]
    for r in results:
        r["bookkeeping_vs_smallest"] = r["bookkeeping_ms_per_selected_group"] / first \
            if first else float("nan")
    summary = {
        "benchmark": "scale", "machine": f"{os.cpu_count()} CPUs",
        "agents": f"sleeping, log-normal median {args.median_s} s, no model call",
        "slots": args.slots, "train_batch_size": args.tbs, "n": args.n,
        "steps_per_size": args.steps, "results": results,
    }
    print(json.dumps(summary, indent=1))
    print("\n| active groups | fill s | select ms/step | top-up ms/step | bookkeeping ms per "
          "selected group | vs smallest | Redis bytes per active rollout | completed->selected "
          "p50/p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['active_groups']} | {r['fill_s']:.1f} | {r['select_ms_per_step']:.2f} | "
              f"{r['top_up_ms_per_step']:.1f} | {r['bookkeeping_ms_per_selected_group']:.3f} | "
              f"{r['bookkeeping_vs_smallest']:.2f}x | "
              f"{r['redis_bytes_per_active_rollout']:.0f} | "
              f"{r['completed_to_selected_ms']['p50']:.0f}/"
              f"{r['completed_to_selected_ms']['p99']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

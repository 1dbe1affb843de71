"""What a weight update costs when the agents' calls are long: wait for them, freeze them,
end them, or end and carry them on (``gateway.drain_mode`` wait, keep, abort, continue),
side by side on the real stack.

Starts its own Redis, vLLM CPU server, gateway, Celery workers and the real trainer, then
trains the tiny model in carry-over mode (``async_train_batch_size`` 2x) with agents that
make ``--calls`` calls of exactly ``--max-tokens`` tokens each (``bench/agents.py``
``long_calls``). Each mode runs ``--warmup`` steps, then ``--steps`` timed steps.

Per mode: the seconds per step spent pausing (the drain under wait; pausing the engines
under keep, abort and continue), the seconds the gateway stayed paused, the calls frozen,
aborted or carried on per step, the trainer's idle fraction (1 - the seconds it updates,
saves, loads and probes / wall: waiting for data or for a drain is idle), trained rollouts
per second, and the trained calls that spanned an update.

Usage: python -m bench.drain_modes [--quick] [--modes wait,keep,abort,continue] [--steps 8]
       [--max-tokens 256] [--calls 2]
Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROLES = ["redis", "inference", "gateway", "groups", "rollout", "trainer"]
MODES = ("wait", "keep", "abort", "continue")


def run_mode(base: list[str], data, tmp, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from app.config import load_config
    from app.driver.loop import new_run_id, train

    total = args.warmup + args.steps
    cfg = load_config(None, [
        *base, f"data.train_files={data}", f"data.train_batch_size={args.tbs}",
        f"actor_rollout_ref.rollout.n={args.n}", f"trainer.total_steps={total}",
        "agentlightning.async_rollout.enabled=true",
        f"agentlightning.async_rollout.async_train_batch_size={2 * args.tbs}",
        f"gateway.drain_mode={mode}", "controller.agent=bench.agents:long_calls",
        f"agent.calls={args.calls}", f"agent.max_tokens={args.max_tokens}",
        f"logging.dir={tmp / 'runs'}", "logging.wandb_mode=disabled", "logging.console=false",
        f"trainer.weights_dir={tmp / 'weights'}", f"trainer.checkpoint_dir={tmp / 'ckpt'}",
        f"trainer.save_freq={total}"])
    rows: list[dict] = []
    marks: list[float] = []

    def on_step(step: int, metrics: dict) -> None:
        rows.append(metrics)
        marks.append(time.time())

    train(cfg, on_step=on_step, run_id=new_run_id())
    timed = rows[args.warmup:]
    wall = marks[-1] - marks[args.warmup - 1]

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key) or 0.0) for r in timed)

    return {
        "drain_mode": mode, "steps_timed": len(timed), "wall_s": wall,
        "pause_s_per_step": mean("training/async/proxy_drain_seconds"),
        "gateway_paused_s_per_step": mean("timing/gateway_paused_seconds"),
        "inflight_at_pause": mean("training/async/proxy_inflight_at_pause"),
        "frozen_calls_per_step": mean("training/async/proxy_frozen_calls"),
        "aborted_calls_per_step": mean("training/async/proxy_aborted_calls"),
        "continued_calls_per_step": mean("training/async/proxy_continued_calls"),
        # the trainer working: update, save, reload, probe (not waiting for data or a drain)
        "trainer_idle_fraction": 1.0 - sum(
            sum(float(r.get(f"timing/trainer_{k}_seconds") or 0.0)
                for k in ("update", "save", "reload", "probe")) for r in timed) / wall,
        "trainer_step_seconds": mean("timing/update_seconds"),
        "trained_rollouts_per_s": sum(r["training/async/n_completed_rollouts"]
                                      for r in timed) / wall,
        "mixed_version_samples_per_step": mean("batch/mixed_version_samples"),
        "sample_version_lag_mean": mean("policy/sample_version_lag_mean"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI's smoke test: a few short steps")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tbs", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.tbs, args.n, args.max_tokens = 2, 1, 1, 2, 64
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {unknown}; modes are {', '.join(MODES)}")

    from bench.stack import bench_stack

    results = []
    with bench_stack(ROLES) as (base, tmp):
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n"
                                for t in ("abc", "bad", "cab", "dab", "bcd", "dca")))
        for mode in modes:
            r = run_mode(base, data, tmp, mode, args)
            results.append(r)
            print(f"# {mode}: {r['pause_s_per_step']:.2f} s pausing per step, "
                  f"{r['trained_rollouts_per_s']:.2f} trained rollouts/s", file=sys.stderr,
                  flush=True)
    summary = {"benchmark": "drain_modes", "machine": f"{os.cpu_count()} CPUs",
               "max_tokens": args.max_tokens, "calls_per_rollout": args.calls,
               "train_batch_size": args.tbs, "n": args.n, "results": results}
    print(json.dumps(summary, indent=1))
    print("\n| drain_mode | pausing s/step | gateway paused s/step | calls frozen / aborted / "
          "carried on per step | trainer step s | trainer idle | trained rollouts/s | trained "
          "calls spanning a load, per step | version lag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['drain_mode']} | {r['pause_s_per_step']:.2f} | "
              f"{r['gateway_paused_s_per_step']:.2f} | {r['frozen_calls_per_step']:.1f} / "
              f"{r['aborted_calls_per_step']:.1f} / {r['continued_calls_per_step']:.1f} | "
              f"{r['trainer_step_seconds']:.1f} | "
              f"{r['trainer_idle_fraction']:.0%} | {r['trained_rollouts_per_s']:.2f} | "
              f"{r['mixed_version_samples_per_step']:.1f} | "
              f"{r['sample_version_lag_mean']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Asynchronous vs synchronous training in steady state, with the staleness it costs, on the
real stack.

Starts its own Redis, vLLM CPU server, gateway, Celery workers (``--slots`` rollout slots) and
the real trainer, then trains the tiny model with agents that make one real model call and
sleep for a duration drawn from the workload's distribution (``bench/agents.py``: fixed, or
log-normal with the same median). Per workload the modes run back to back on the same seeds
(the n-th group gets the same durations in every mode): sync; carry-over at
``async_train_batch_size`` 1.5x, 2x and 3x ``train_batch_size``; carry-over at 2x with
``max_carry_over_age_steps`` 1 and 2 (the staleness-bounded variant), each with the cap's
``cancel`` strategy (``x2cap1``, ``x2cap2``: the group is cancelled, its finished siblings
wasted) and its ``wait`` strategy (``x2cap1wait``, ``x2cap2wait``: the step waits for it).

Steady state. Each step records the ages (``step - dispatch_step``) of the groups in flight.
The warm-up ends at the first step (at least ``--min-warmup``) where the mean in-flight age,
averaged over the last 3 steps, differs by at most 0.25 steps from the average over the 3
steps before; at most ``--max-warmup`` steps. Then ``--steps`` steps are timed.

Figures per mode, over the timed window: trained rollouts per second (the headline: only
trained work counts; groups still in flight at the end are charged to the run), steps per
minute, the accounting of every dispatched group (trained, cancelled by the age cap, dropped,
in flight at the end) and the slot time spent on cancelled work (waste), and the staleness of
what was trained: the age of trained groups in policy versions (mean, p90, max) and the mean
of ``policy/sample_version_lag_mean``.

The ideal no schedule can beat: ``slots / E[rollout seconds]`` trained rollouts per second,
with E the mean of the workload's distribution as the agents draw it (a log-normal truncated
at ``max_s``, known exactly) and no update time added, since on CPU the update overlaps the
rollouts (the gateway pauses only for the weight load). A mode above 100% of it means the
bench or the formula is wrong: the bench says so and exits 1.

Usage: python -m bench.async_vs_sync [--quick] [--sigmas 0.5,1.0,1.5] [--no-fixed]
       [--modes sync,x1.5,x2,x3,x2cap1,x2cap2,x2cap1wait,x2cap2wait] [--steps 30]
       [--slots 16] [--tbs 4] [--n 4] [--median-s 2.0] [--out var/bench]
Prints JSON, then a markdown table; writes a PNG of trained rollouts/s against sample age.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROLES = ["redis", "inference", "gateway", "groups", "rollout", "trainer"]
MAX_S = 60.0  # bench.agents.timed's cap on one sleep
# mode -> (async_train_batch_size / train_batch_size, age cap, the cap's strategy)
MODES = {"sync": (None, None, None), "x1.5": (1.5, None, None), "x2": (2.0, None, None),
         "x3": (3.0, None, None), "x2cap1": (2.0, 1, "cancel"), "x2cap2": (2.0, 2, "cancel"),
         "x2cap1wait": (2.0, 1, "wait"), "x2cap2wait": (2.0, 2, "wait")}


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def expected_duration(dist: str, median_s: float, sigma: float, max_s: float = MAX_S) -> float:
    """E[min(X, max_s)] of the agents' sleep: exact for the fixed and log-normal workloads."""
    if dist == "fixed" or sigma == 0:
        return min(median_s, max_s)
    mu = math.log(median_s)

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    lm = math.log(max_s)
    return (math.exp(mu + sigma * sigma / 2) * phi((lm - mu - sigma * sigma) / sigma)
            + max_s * (1.0 - phi((lm - mu) / sigma)))


def warmup_end(ages: list[float], min_warmup: int, max_warmup: int) -> int | None:
    """The number of warm-up steps once the in-flight age distribution stopped changing
    (module docstring): ``max_warmup`` at the latest; None while still undecided."""
    for s in range(max(min_warmup, 6) - 1, min(len(ages), max_warmup)):
        recent = statistics.fmean(ages[s - 2:s + 1])
        before = statistics.fmean(ages[s - 5:s - 2])
        if abs(recent - before) <= 0.25:
            return s + 1
    return max_warmup if len(ages) >= max_warmup else None


def run_mode(base: list[str], data: Path, tmp: Path, dist: str, sigma: float, mode: str,
             args: argparse.Namespace) -> dict[str, Any]:
    from app.config import load_config
    from app.driver.loop import new_run_id, train
    from app.state import keys
    from app.state.connection import connect, resolve_redis_url
    from app.state.records import SiblingResult

    ratio, cap, strategy = MODES[mode]
    atbs = max(args.tbs + 1, round(args.tbs * ratio)) if ratio else 2 * args.tbs
    total = args.max_warmup + args.steps
    cfg = load_config(None, [
        *base, f"data.train_files={data}", f"data.train_batch_size={args.tbs}",
        f"actor_rollout_ref.rollout.n={args.n}", f"trainer.total_steps={total}",
        f"agentlightning.async_rollout.enabled={'true' if ratio else 'false'}",
        f"agentlightning.async_rollout.async_train_batch_size={atbs}",
        f"agentlightning.async_rollout.max_carry_over_age_steps={cap if cap else 'null'}",
        f"agentlightning.async_rollout.max_carry_over_age_strategy={strategy or 'cancel'}",
        "controller.agent=bench.agents:timed",
        f"agent.dist={dist}", f"agent.sigma={sigma}", f"agent.median_s={args.median_s}",
        f"agent.seed={args.seed}", f"logging.dir={tmp / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp / 'weights'}",
        f"trainer.checkpoint_dir={tmp / 'checkpoints'}", f"trainer.save_freq={total}",
        "trainer.trained_data_ttl_s=86400"])  # the accounting reads every group at the end
    client = connect(resolve_redis_url(cfg))
    rows: list[dict] = []
    marks: list[float] = []
    inflight_age: list[float] = []
    state: dict[str, Any] = {"timed_from": None, "active_at_end": set()}
    run_id = new_run_id()

    def on_step(step: int, metrics: dict) -> None:
        rows.append(metrics)
        marks.append(time.time())
        active = client.zrange(keys.run_active(run_id), 0, -1)
        # in flight when the run ends (the run then cancels them: not the age cap's doing)
        state["active_at_end"] = set(active)
        pipe = client.pipeline(transaction=False)
        for gid in active:
            pipe.hget(keys.group(gid), "dispatch_step")
        ages = [step - int(d) for d in pipe.execute() if d is not None] if active else []
        inflight_age.append(statistics.fmean(ages) if ages else 0.0)

    def should_stop(step: int, metrics: dict) -> bool:
        if state["timed_from"] is None:
            # sync carries nothing over: its steps are alike once the first is done
            state["timed_from"] = args.min_warmup if ratio is None else warmup_end(
                inflight_age, args.min_warmup, args.max_warmup)
        return state["timed_from"] is not None and len(rows) >= state["timed_from"] + args.steps

    # Why slots idle: every 0.25 s, the rollouts of active groups not yet finished (queued
    # or running). Below ``slots``, the pool itself is short of work; at or above it, idle
    # slots come from dispatch latency instead.
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample_unfinished() -> None:
        while not stop.wait(0.25):
            pipe = client.pipeline(transaction=False)
            pipe.zcard(keys.run_active(run_id))
            pipe.hget(keys.run(run_id), "finished_active")
            active, finished = pipe.execute()
            samples.append((time.time(), int(active) * args.n - int(finished or 0)))

    sampler = threading.Thread(target=sample_unfinished, daemon=True)
    sampler.start()
    try:
        train(cfg, on_step=on_step, run_id=run_id, should_stop=should_stop)
    finally:
        stop.set()
        sampler.join()
    w = state["timed_from"]
    timed = rows[w:w + args.steps]
    t0, t1 = marks[w - 1], marks[w + len(timed) - 1]
    wall = t1 - t0

    # Every dispatched group, accounted for.
    trained_at: dict[str, int] = {}
    for step in range(len(rows)):
        for gid in client.lrange(keys.run_step_groups(run_id, step), 0, -1):
            trained_at[gid] = step
    statuses: dict[str, int] = {"trained": 0, "cancelled": 0, "dropped": 0, "in_flight": 0}
    waste = busy = 0.0
    versions: list[int] = []
    seq = 0
    while client.exists(keys.group(f"{run_id}-g{seq}")):
        gid = f"{run_id}-g{seq}"
        seq += 1
        status = client.hget(keys.group(gid), "status")
        kind = ("trained" if gid in trained_at
                else "in_flight" if gid in state["active_at_end"]
                else "cancelled" if status == "cancelled"
                else "dropped" if status == "dropped" else "in_flight")
        statuses[kind] += 1
        for raw in client.hvals(keys.group_results(gid)):
            r = SiblingResult.from_json(raw)
            begun = r.finished_at - r.seconds
            overlap = max(0.0, min(r.finished_at, t1) - max(begun, t0))
            busy += overlap
            if kind == "cancelled":
                waste += overlap
        if gid in trained_at and w <= trained_at[gid] < w + len(timed):
            row = rows[trained_at[gid]]
            versions.append(int(row["policy/version"]) - 1
                            - int(client.hget(keys.group(gid), "dispatch_version")))
    trained_rollouts = sum(r["training/async/n_completed_rollouts"] for r in timed)
    unfinished = [u for t, u in samples if t0 <= t <= t1]
    versions.sort()
    return {
        "mode": "sync" if ratio is None else
                f"async x{ratio:g}" + (f" cap {cap} {strategy}" if cap else ""),
        "dist": dist, "sigma": sigma if dist != "fixed" else 0.0,
        "ratio": ratio or 1.0, "age_cap": cap, "age_strategy": strategy,
        "async_train_batch_size": atbs if ratio
        else args.tbs,
        "warmup_steps": w, "steps_timed": len(timed), "wall_s": wall,
        "trained_rollouts_per_s": trained_rollouts / wall if wall > 0 else 0.0,
        "steps_per_min": 60.0 * len(timed) / wall if wall > 0 else 0.0,
        "groups": {"dispatched": seq, **statuses},
        "slot_utilisation": busy / (args.slots * wall) if wall > 0 else 0.0,
        "unfinished_rollouts_mean": statistics.fmean(unfinished) if unfinished else 0.0,
        "time_unfinished_below_slots": sum(u < args.slots for u in unfinished)
        / len(unfinished) if unfinished else 0.0,
        "waste_slot_s": waste,
        "trainer_idle_fraction": 1.0 - sum(r["timing/update_seconds"] for r in timed) / wall
        if wall > 0 else 0.0,
        "sample_age_versions": {
            "mean": statistics.fmean(versions) if versions else 0.0,
            "p90": versions[int(0.9 * (len(versions) - 1))] if versions else 0,
            "max": versions[-1] if versions else 0},
        "sample_version_lag_mean": statistics.fmean(
            r["policy/sample_version_lag_mean"] for r in timed) if timed else 0.0,
        "drain_s_mean": statistics.fmean(
            r["training/async/proxy_drain_seconds"] for r in timed) if timed else 0.0,
        # the wait strategy: the part of each step's wait spent on groups past the cap
        "wait_for_overdue_s_mean": statistics.fmean(
            r.get("timing/wait_for_overdue_seconds", 0.0) for r in timed) if timed else 0.0,
    }


def plot(results: list[dict], ideals: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (label, ideal) in enumerate(ideals.items()):
        color = f"C{i}"
        mine = [r for r in results if r["label"] == label]
        ax.scatter([r["sample_age_versions"]["mean"] for r in mine],
                   [r["trained_rollouts_per_s"] for r in mine], color=color, label=label)
        for r in mine:
            ax.annotate(r["mode"].replace("async ", ""), (r["sample_age_versions"]["mean"],
                                                         r["trained_rollouts_per_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(ideal, color=color, ls="--", lw=1)
    top = max([*ideals.values(), *(r["trained_rollouts_per_s"] for r in results)])
    ax.set_ylim(0, top * 1.1)  # the ideal lines stay in view
    ax.set_xlabel("mean age of trained samples (policy versions)")
    ax.set_ylabel("trained rollouts per second")
    ax.set_title("Throughput against staleness, steady state (dashed: ideal)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="CI's smoke test: one workload, three modes, a few short steps")
    ap.add_argument("--sigmas", default="0.5,1.0,1.5")
    ap.add_argument("--no-fixed", action="store_true", help="skip the fixed-duration control")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--min-warmup", type=int, default=3)
    ap.add_argument("--max-warmup", type=int, default=15)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tbs", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--median-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "var" / "bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.sigmas, args.no_fixed, args.modes = "1.0", True, "sync,x2,x2cap1,x2cap1wait"
        args.steps, args.min_warmup, args.max_warmup = 3, 1, 3
        args.slots, args.tbs, args.n, args.median_s = 4, 1, 2, 0.2
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; modes are {', '.join(MODES)}")

    from bench.stack import ATTACH_ENV, bench_stack

    dists = ([] if args.no_fixed else [("fixed", 0.0)]) + [
        ("lognormal", s) for s in parse_floats(args.sigmas)]
    results: list[dict] = []
    ideals: dict[str, float] = {}
    with bench_stack(ROLES, f"services.rollout_concurrency={args.slots}") as (base, tmp):
        if os.environ.get(ATTACH_ENV):  # the attached stack's own slots bound what runs
            from app.config import service_config

            args.slots = int(service_config().services.rollout_concurrency)
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"text": t, "target": t[::-1]}) + "\n"
                                for t in ("abc", "bad", "cab", "dab", "bcd", "dca", "acd", "bba")))
        for dist, sigma in dists:
            label = "fixed" if dist == "fixed" else f"lognormal sigma {sigma:g}"
            ideals[label] = args.slots / expected_duration(dist, args.median_s, sigma)
            for mode in modes:  # every mode of one workload back to back, same seeds
                r = run_mode(base, data, tmp, dist, sigma, mode, args)
                r["label"] = label
                r["ideal_rollouts_per_s"] = ideals[label]
                r["fraction_of_ideal"] = r["trained_rollouts_per_s"] / ideals[label]
                results.append(r)
                print(f"# {label:22s} {r['mode']:16s} {r['trained_rollouts_per_s']:.2f} "
                      f"trained rollouts/s ({r['fraction_of_ideal']:.0%} of ideal)",
                      file=sys.stderr, flush=True)
    for label in ideals:
        mine = [r for r in results if r["label"] == label]
        sync = next((r for r in mine if r["mode"] == "sync"), None)
        for r in mine:
            r["speedup_vs_sync"] = (r["trained_rollouts_per_s"] / sync["trained_rollouts_per_s"]
                                    if sync and sync["trained_rollouts_per_s"] else math.nan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "async_vs_sync.png"
    plot(results, ideals, png)
    summary = {
        "benchmark": "async_vs_sync", "machine": f"{os.cpu_count()} CPUs",
        "trainer": "real (the update on verl's engine, weight sync to vLLM)",
        "slots": args.slots, "train_batch_size": args.tbs, "n": args.n,
        "timed_steps": args.steps, "median_rollout_s": args.median_s, "seed": args.seed,
        "ideal_formula": "slots / E[min(rollout sleep, max_s)] trained rollouts per second "
                         "(E exact for the workload's distribution; the CPU update overlaps "
                         "rollouts)",
        "warmup_rule": "ends when the mean in-flight age over the last 3 steps is within 0.25 "
                       "steps of the 3 before (min/max warm-up steps bound it)",
        "plot": str(png), "results": results,
    }
    print(json.dumps(summary, indent=1))
    print("\n| workload | mode | trained rollouts/s | of ideal | vs sync | steps/min | "
          "sample age mean/p90/max | version lag | groups dispatched/trained/cancelled/"
          "in flight | waste slot-s | overdue wait s/step | slot util | unfinished rollouts "
          "mean (time below slots) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g, a = r["groups"], r["sample_age_versions"]
        print(f"| {r['label']} | {r['mode']} | {r['trained_rollouts_per_s']:.2f} | "
              f"{r['fraction_of_ideal']:.0%} | {r['speedup_vs_sync']:.2f}x | "
              f"{r['steps_per_min']:.1f} | {a['mean']:.2f}/{a['p90']}/{a['max']} | "
              f"{r['sample_version_lag_mean']:.2f} | {g['dispatched']}/{g['trained']}/"
              f"{g['cancelled']}/{g['in_flight']} | {r['waste_slot_s']:.0f} | "
              f"{r['wait_for_overdue_s_mean']:.2f} | "
              f"{r['slot_utilisation']:.0%} | {r['unfinished_rollouts_mean']:.1f} "
              f"({r['time_unfinished_below_slots']:.0%}) |")
    problem = above_ideal(results)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


def above_ideal(results: list[dict]) -> str | None:
    """What is wrong when a mode beats the ideal (which no schedule can), else None."""
    over = [r for r in results
            if r["trained_rollouts_per_s"] > r["ideal_rollouts_per_s"] * (1 + 1e-9)]
    if not over:
        return None
    return ("above the ideal, which no schedule can reach (the bench or the formula is wrong): "
            + ", ".join(f"{r['label']} {r['mode']} "
                        f"{r['trained_rollouts_per_s'] / r['ideal_rollouts_per_s']:.0%}"
                        for r in over))


if __name__ == "__main__":
    sys.exit(main())

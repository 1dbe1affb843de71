"""``carryover demo``: start every process, train the demo agent, stop every process.

What the user sees: which part is starting, a progress bar with ETA and one line per step,
then a summary table, a PNG plot and where the files went. Every process started here is
stopped in order on the way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from app.config import ConfigError, load_config
from app.config.loader import REPO_ROOT, env_overrides
from app.config.schema import Config
from app.driver.metrics import CARRY, Metrics, console_line, val_line
from app.driver.preflight import preflight

if TYPE_CHECKING:
    from app.services.supervisor import RoleFailing, Supervisor

# the main demo: a long-running agent on a real model; config/demo.yaml is the tiny toy
DEMO_CONFIG = REPO_ROOT / "config" / "long-agent.yaml"
log = logging.getLogger(__name__)


class DemoRun(TypedDict):
    """One mode's run: what ``train`` returned (``app.driver.loop.TrainResult``) and what
    the demo adds to it."""

    run_id: str
    steps: int
    run_dir: str
    jsonl: str
    wandb_dir: str | None
    wall_seconds: float
    rows: list[Metrics]               # each step's metrics, with its step
    evals: list[dict[str, float]]     # each evaluation's val/* metrics, with its step
    label: str                        # the mode
    plot: str                         # the PNG's path


def _number(value: object) -> float:
    """A metric's value as a number (it is one: a sum or a mean of others would fail)."""
    if not isinstance(value, (int, float)):
        raise TypeError(f"a metric's value is a {type(value).__name__}, not a number")
    return value


def _overrides(args: argparse.Namespace, sync: bool) -> list[str]:
    out = [*env_overrides(), *args.overrides]
    flags = {"trainer.total_steps": "--steps" if args.steps is not None else None,
             "agentlightning.async_rollout.enabled":
                 "--sync" if getattr(args, "sync", False) else
                 "--compare" if getattr(args, "compare", False) else None}
    both = [f"{flag} and {key}=... both given: keep one" for key, flag in flags.items()
            if flag and any(o.lstrip("+").partition("=")[0].strip() == key
                            for o in args.overrides)]
    if both:
        raise ConfigError(both)
    if args.steps is not None:  # 0 is refused by validation, not dropped
        out.append(f"trainer.total_steps={args.steps}")
    if sync:
        out.append("agentlightning.async_rollout.enabled=false")
    return out


def _train_one(cfg: Config, label: str) -> DemoRun:
    from tqdm import tqdm

    from app.driver.loop import run_dir_for, train

    total = int(cfg.trainer.total_steps)
    bar = tqdm(total=total, desc=f"{label} training", unit="step", dynamic_ncols=True,
               file=sys.stderr)
    rows: list[Metrics] = []
    evals: list[dict[str, float]] = []

    def on_step(step: int, metrics: Metrics) -> None:
        rows.append({"step": step, **metrics})
        bar.write(console_line(step, total, metrics))
        bar.set_postfix(reward=f"{metrics.get('reward/mean') or 0:.2f}")
        bar.update(1)

    def on_eval(step: int, metrics: dict[str, float]) -> None:
        evals.append({"step": step, **metrics})
        bar.write(val_line(step, metrics))

    started = time.monotonic()
    try:
        result = train(cfg, on_step=on_step, on_eval=on_eval)
    finally:
        bar.close()
    return {**result, "wall_seconds": time.monotonic() - started, "rows": rows,
            "evals": evals, "label": label,
            "plot": str(plot_run(rows, run_dir_for(cfg, result["run_id"]) / "demo.png", label,
                                 evals))}


def summarize(result: DemoRun) -> dict[str, float]:
    rows = result["rows"]
    rewards = [_number(r.get("reward/mean") or 0.0) for r in rows]
    steps_time = sum(_number(r["timing/step_seconds"]) for r in rows)
    waited = sum(_number(r["timing/wait_for_data_seconds"]) for r in rows)
    first = statistics.fmean(rewards[:2]) if rewards else 0.0
    last = statistics.fmean(rewards[-5:]) if rewards else 0.0
    return {
        "steps": len(rows),
        "steps_per_minute": 60 * len(rows) / steps_time if steps_time else 0.0,
        "reward_first_2": first,
        "reward_last_5": last,
        "reward_gain": last - first,
        "trainer_idle_fraction": waited / steps_time if steps_time else 0.0,
        "mean_step_seconds": steps_time / len(rows) if rows else 0.0,
        "carried_over_rollouts_total": sum(
            _number(r.get(CARRY + "n_new_carry_over_rollouts") or 0) for r in rows),
        "mean_drain_seconds": statistics.fmean(
            _number(r.get(CARRY + "proxy_drain_seconds") or 0) for r in rows) if rows else 0.0,
        **_eval_summary(result.get("evals") or []),
    }


def _eval_summary(evals: list[dict[str, float]]) -> dict[str, float]:
    """Held-out success before training and at the end, when the run evaluates."""
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    return {"val_success_first": first["val/success_rate"],
            "val_success_last": last["val/success_rate"],
            "val_success_gain": last["val/success_rate"] - first["val/success_rate"],
            "val_reward_last": last["val/reward_mean"]}


def plot_run(rows: list[Metrics], path: Path, label: str,
             evals: list[dict[str, float]] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [_number(r["step"]) + 1 for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    fig.suptitle(f"carryover demo ({label})")
    ax = axes[0][0]
    ax.plot(steps, [r.get("reward/mean") or 0 for r in rows], label="mean reward")
    ax.set_title("reward by step")
    ax.set_ylim(0, 1)
    if evals:
        # an evaluation reported after step s measured the weights of update sent_at_step
        ax.plot([e["val/sent_at_step"] for e in evals], [e["val/success_rate"] for e in evals],
                "o-", label="held-out success")
        ax.set_title("reward by step, held-out success by update")
        ax.legend()
    ax = axes[0][1]
    # Distinct line styles: the three series are often equal (e.g. 64 each) and would hide
    # each other.
    for (name, key), style in zip((("inherited", "n_prev_carry_over_rollouts"),
                                   ("consumed", "n_completed_rollouts"),
                                   ("carried over", "n_new_carry_over_rollouts")),
                                  ("-", "--", ":"), strict=True):
        ax.plot(steps, [r.get(CARRY + key) or 0 for r in rows], style, lw=2, label=name)
    ax.set_title("rollouts per step")
    ax.legend()
    ax = axes[1][0]
    ax.plot(steps, [r.get(CARRY + "proxy_drain_seconds") or 0 for r in rows])
    ax.set_title("gateway drain seconds")
    ax = axes[1][1]
    ax.plot(steps, [r["timing/step_seconds"] for r in rows], label="step")
    ax.plot(steps, [r["timing/wait_for_data_seconds"] for r in rows], label="waiting for data")
    ax.plot(steps, [r["timing/update_seconds"] for r in rows], label="update + sync")
    ax.set_title("seconds per step")
    ax.legend()
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _table(results: list[DemoRun]) -> str:
    sums = [summarize(r) for r in results]
    names = list(sums[0])
    head = "metric".ljust(28) + "".join(r["label"].rjust(14) for r in results)
    lines = [head, "-" * len(head)]
    for n in names:
        lines.append(n.ljust(28) + "".join(f"{s[n]:>14.3f}" if isinstance(s[n], float)
                                           else f"{s[n]:>14}" for s in sums))
    return "\n".join(lines)


def _time_to_accuracy(results: list[DemoRun]) -> str:
    """Both modes' minutes of training to the held-out threshold, with a plot of both."""
    from app.accuracy import Runs, compare, plot, table

    if not all(r.get("evals") for r in results):
        return "time to accuracy: the config does not evaluate (data.val_files), nothing to compare"
    runs: Runs = {r["label"]: [[*r["rows"], *r["evals"]]] for r in results}
    result = compare(runs)
    path = Path(results[-1]["plot"]).with_name("time-to-accuracy.png")
    plot(result, path, "held-out success: asynchronous vs synchronous")
    return table(result) + f"\n  plot     {path}"


def run_demo(args: argparse.Namespace) -> int:
    from app.driver.step import TrainingFailed
    from app.services.supervisor import StartupError, Supervisor

    config_path = args.config or str(DEMO_CONFIG)
    modes = ["async", "sync"] if args.compare else (["sync"] if args.sync else ["async"])
    cfgs = {m: load_config(config_path, _overrides(args, m == "sync")) for m in modes}
    first = cfgs[modes[0]]
    # a bad data file or agent is reported before the stack starts (the modes differ only in
    # async_rollout.enabled: one check covers them all)
    preflight(first)
    os.environ["CARRYOVER_CONFIG"] = os.path.abspath(config_path)
    os.environ["CARRYOVER_OVERRIDES"] = json.dumps(_overrides(args, False))
    print(f"starting the stack (logs in {REPO_ROOT / 'var' / 'logs'}) ...", flush=True)
    results = []
    failing: list[RoleFailing] = []
    sup = Supervisor(first)
    try:
        sup.start(progress=lambda role: print(f"  {role} ready", flush=True))
        print(f"Flower: http://127.0.0.1:{first.services.flower_port}   "
              f"gateway: {first.gateway.url}", flush=True)
        with _roles_kept_up(sup, failing):
            for mode in modes:
                results.append(_train_one(cfgs[mode], mode))
        if failing:
            print(f"error: {failing[0]}", file=sys.stderr)
            return 1
    except (StartupError, TrainingFailed) as exc:  # one line, as `carryover train` says it
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if failing:
            print(f"error: {failing[0]}", file=sys.stderr)
            return 1
        print("\ninterrupted; stopping every process", file=sys.stderr)
        return 130
    finally:
        print("stopping the stack ...", flush=True)
        sup.stop()
    _print_results(results, args.compare)
    return 0


@contextlib.contextmanager
def _roles_kept_up(sup: Supervisor, failing: list[RoleFailing]) -> Iterator[None]:
    """While the runs go on, a role that exits is started again; one that keeps failing
    is put in ``failing`` and the main thread interrupted (the run cannot go on)."""
    import _thread
    import threading

    from app.services.supervisor import RoleFailing

    done = threading.Event()

    def keep_roles_up() -> None:
        try:
            sup.watch_forever(stop=done.is_set)
        except RoleFailing as exc:
            failing.append(exc)
            _thread.interrupt_main()

    watcher = threading.Thread(target=keep_roles_up, name="supervisor", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(5)


def _print_results(results: list[DemoRun], compare: bool) -> None:
    print()
    print(_table(results))
    if compare:
        print()
        print(_time_to_accuracy(results))
    for r in results:
        print(f"\n{r['label']}: run {r['run_id']}\n  metrics  {r['jsonl']}\n  plot     {r['plot']}"
              + (f"\n  W&B      {r['wandb_dir']} (offline; `wandb sync` uploads it)"
                 if r.get("wandb_dir") else ""))

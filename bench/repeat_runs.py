"""What a fresh clone's demo shows: ``carryover demo`` run several times in a row, each on a
stack of its own, with the median and range of its learning figures.

For each run: the mean reward over the first 2 and the last 5 steps and their difference
(the demo's gain), the minutes of training (the steps' own time, start-up and evaluations
outside steps excluded), and, for a config that evaluates (``data.val_files``), the
held-out success rate after each evaluation and the minutes of training before each.

Run it with nothing else on the machine: a second load slows the steps (and the
asynchronous timing changes what is trained).

``--plot PNG`` draws each run's held-out success (or, without evaluations, its reward)
against minutes of training, labelled by ``--labels`` (one per run, comma-separated).

Usage: python -m bench.repeat_runs [--runs 3] [--config config/arith.yaml] [--log-dir DIR]
       python -m bench.repeat_runs --metrics a.jsonl b.jsonl ...   (summarise finished runs)
       [--plot out.png --labels a,b,...]
(prints JSON)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_once(config: str | None, log: Path, extra: list[str]) -> Path:
    """One ``carryover demo`` (its own stack, started and stopped); returns its metrics."""
    cmd = [str(REPO / ".venv" / "bin" / "carryover"), "demo", *extra]
    if config:
        cmd += ["--config", config]
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text(errors="replace")
    found = re.search(r"metrics\s+(\S+metrics\.jsonl)", text)
    if code != 0 or not found:
        raise SystemExit(f"carryover demo failed (exit {code}); its output is in {log}")
    return Path(found.group(1))


def summarise(path: Path) -> dict[str, Any]:
    steps, evals = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        (evals if "val/success_rate" in row else steps).append(row)
    rewards = [s.get("reward/mean") or 0.0 for s in steps]
    seconds = [s["timing/step_seconds"] for s in steps]
    first, last = statistics.fmean(rewards[:2]), statistics.fmean(rewards[-5:])
    out: dict[str, Any] = {"run": path.parent.name, "steps": len(steps),
                           "training_minutes": sum(seconds) / 60, "reward_first_2": first,
                           "reward_last_5": last, "reward_gain": last - first}
    if evals:
        out["val_success"] = {str(int(e["val/sent_at_step"])): e["val/success_rate"]
                              for e in evals}
        out["minutes_before_eval"] = {k: sum(seconds[:int(k)]) / 60
                                      for k in out["val_success"]}
    return out


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def plot(paths: list[Path], labels: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path, label in zip(paths, labels, strict=True):
        steps, evals = [], []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            (evals if "val/success_rate" in row else steps).append(row)
        minutes = [0.0]
        for s in steps:
            minutes.append(minutes[-1] + s["timing/step_seconds"] / 60)
        if evals:
            x = [minutes[int(e["val/sent_at_step"])] for e in evals]
            y = [e["val/success_rate"] for e in evals]
        else:
            x, y = minutes[1:], [s.get("reward/mean") or 0.0 for s in steps]
        ax.plot(x, y, marker="o" if len(x) <= 30 else None, label=label)
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out success" if evals else "trained reward (the step's groups)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", default=None, help="the demo's config (default: config/demo.yaml)")
    ap.add_argument("--log-dir", type=Path, default=REPO / "var" / "repeats")
    ap.add_argument("--metrics", type=Path, nargs="*", help="finished runs' metrics.jsonl")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the runs")
    ap.add_argument("--labels", default=None, help="one label per run, comma-separated")
    ap.add_argument("demo_args", nargs="*", help="more arguments for carryover demo")
    args = ap.parse_args(argv)
    paths = list(args.metrics or [])
    if not paths:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(args.runs):
            paths.append(run_once(args.config, args.log_dir / f"run-{i + 1}.log", args.demo_args))
            print(f"run {i + 1}/{args.runs}: {paths[-1]}", file=sys.stderr, flush=True)
    runs = [summarise(p) for p in paths]
    summary: dict[str, Any] = {
        "runs": runs,
        "reward_gain": spread([r["reward_gain"] for r in runs]),
        "training_minutes": spread([r["training_minutes"] for r in runs]),
    }
    if all("val_success" in r for r in runs):
        after = sorted(set.intersection(*(set(r["val_success"]) for r in runs)), key=int)
        summary["val_success"] = {k: spread([r["val_success"][k] for r in runs]) for k in after}
        summary["minutes_before_eval"] = {
            k: spread([r["minutes_before_eval"][k] for r in runs]) for k in after}
    print(json.dumps(summary, indent=1))
    if args.plot is not None:
        labels = args.labels.split(",") if args.labels else [r["run"] for r in runs]
        plot(paths, labels, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

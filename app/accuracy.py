"""Time to accuracy: how many minutes of training a run took to reach a held-out success rate.

Read from a run's metrics rows (one per step, as ``metrics.jsonl`` holds them) and its
evaluation rows (``val/*``). An evaluation measures the weights of the update it was sent
after (``val/sent_at_step``), so its time is the training minutes up to that update: the
steps' own time (``timing/step_seconds``, from the first step's wait for data to the last
update's resume), the evaluations that run beside training included, the ones waited for
before training excluded. Used by ``carryover demo --compare`` and ``bench.time_to_accuracy``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

from app.driver.metrics import CARRY

# A metrics file's line: names to JSON values (``app.driver.metrics.Metrics``).
Row = Mapping[str, object]

# The figures compared per mode, each a run summary's key.
Figure = Literal["minutes_to_threshold", "val_success_final", "training_minutes",
                 "trained_rollouts_per_minute", "sample_age_mean_steps", "sample_age_max_steps",
                 "carried_over_rollouts_total", "carry_over_age_max_steps"]


class RunSummary(TypedDict):
    """One run's figures (``run_summary``); the threshold's two only against one."""

    steps: int
    training_minutes: float
    val_success_first: float | None
    val_success_final: float | None
    trained_rollouts_per_minute: float
    sample_age_mean_steps: float
    sample_age_max_steps: float
    carried_over_rollouts_total: float
    carry_over_age_max_steps: float
    curve: list[tuple[float, float]]
    threshold: NotRequired[float]
    minutes_to_threshold: NotRequired[float | None]


class Spread(TypedDict):
    """Median and range of one figure over runs (``spread``)."""

    median: float | None
    min: float | None
    max: float | None
    runs: list[float | None]


class ModeComparison(TypedDict):
    """A mode's runs and the spread of each of ``FIGURES`` over them."""

    runs: list[RunSummary]
    minutes_to_threshold: Spread
    val_success_final: Spread
    training_minutes: Spread
    trained_rollouts_per_minute: Spread
    sample_age_mean_steps: Spread
    sample_age_max_steps: Spread
    carried_over_rollouts_total: Spread
    carry_over_age_max_steps: Spread


class Comparison(TypedDict):
    """``compare``'s answer."""

    threshold: float | None
    modes: dict[str, ModeComparison]
    speedup_to_threshold: NotRequired[float]


def _scalar(value: object) -> int | float | str:
    """A row's value that ``float`` and ``int`` take; anything else raises the TypeError
    they would."""
    if isinstance(value, int | float | str):
        return value
    raise TypeError(f"a metrics value must be a number, not '{type(value).__name__}'")


def split_rows(rows: Iterable[Row]) -> tuple[list[Row], list[Row]]:
    """A metrics file's lines as (step rows, evaluation rows)."""
    steps: list[Row] = []
    evals: list[Row] = []
    for row in rows:
        (evals if "val/success_rate" in row else steps).append(row)
    return steps, evals


def curve(steps: Sequence[Row], evals: Sequence[Row]) -> list[tuple[float, float]]:
    """(minutes of training before the evaluated update, held-out success), in order."""
    minutes = [0.0]
    for s in steps:
        minutes.append(minutes[-1] + float(_scalar(s["timing/step_seconds"])) / 60)
    out = []
    for e in evals:
        at = min(int(_scalar(e["val/sent_at_step"])), len(steps))
        out.append((minutes[at], float(_scalar(e["val/success_rate"]))))
    return out


def minutes_to(points: list[tuple[float, float]], threshold: float) -> float | None:
    """Minutes of training until held-out success first reached ``threshold`` after an
    update; None if never. An evaluation before training (at 0 minutes) is the start, not an
    arrival: a threshold the base model already meets is reached by no training."""
    return next((m for m, s in points if m > 0 and s >= threshold - 1e-9), None)


def run_summary(steps: Sequence[Row], evals: Sequence[Row], threshold: float | None = None
                ) -> RunSummary:
    """One run's figures: final success, throughput, sample age and carry-over."""
    minutes = sum(float(_scalar(s["timing/step_seconds"])) for s in steps) / 60
    trained = sum(float(_scalar(s.get(CARRY + "n_completed_rollouts") or 0)) for s in steps)
    points = curve(steps, evals)

    def values(key: str) -> list[float]:
        return [float(_scalar(s[CARRY + key])) for s in steps
                if s.get(CARRY + key) is not None]

    ages = values("consumed_age_mean_steps")
    oldest = values("consumed_age_max_steps")
    out: RunSummary = {
        "steps": len(steps),
        "training_minutes": minutes,
        "val_success_first": points[0][1] if points else None,
        "val_success_final": points[-1][1] if points else None,
        "trained_rollouts_per_minute": trained / minutes if minutes else 0.0,
        "sample_age_mean_steps": statistics.fmean(ages) if ages else 0.0,
        "sample_age_max_steps": max(oldest, default=0.0),
        "carried_over_rollouts_total": sum(values("n_new_carry_over_rollouts")),
        "carry_over_age_max_steps": max(values("new_carry_over_age_max_steps"), default=0.0),
        "curve": points,
    }
    if threshold is not None:
        out["threshold"] = threshold
        out["minutes_to_threshold"] = minutes_to(points, threshold)
    return out


def spread(values: list[float | None]) -> Spread:
    """Median and range of runs' figures; a run that never got there (None) counts as
    infinitely slow for the median, which is None when it falls there."""
    known = [v for v in values if v is not None]
    mid = statistics.median([math.inf if v is None else v for v in values]) if values else None
    return {"median": None if mid is None or math.isinf(mid) else mid,
            "min": min(known, default=None), "max": max(known, default=None), "runs": values}


FIGURES: tuple[Figure, ...] = (
    "minutes_to_threshold", "val_success_final", "training_minutes",
    "trained_rollouts_per_minute", "sample_age_mean_steps", "sample_age_max_steps",
    "carried_over_rollouts_total", "carry_over_age_max_steps")

# Runs per mode, each its step and evaluation rows.
Runs = Mapping[str, Sequence[Iterable[Row]]]


# How far above the base model's success the default threshold is at least: reaching it
# must take learning, not the spread of one greedy evaluation to the next (about 0.03 here).
MIN_GAIN = 0.1


def default_threshold(runs: Runs) -> float | None:
    """The synchronous runs' median final success minus 0.05, and at least ``MIN_GAIN``
    above the median success before training (a synchronous run that did not learn would
    otherwise set a threshold every run meets before its first update)."""
    base = runs.get("sync") or next(iter(runs.values()), [])
    curves = [p for p in (curve(*split_rows(r)) for r in base) if p]
    if not curves:
        return None
    final = statistics.median(p[-1][1] for p in curves)
    starts = [p[0][1] for p in curves if p[0][0] == 0]  # an evaluation before training
    start = statistics.median(starts) if starts else 0.0
    # at most 1: a base model already near the top leaves a threshold every run can reach
    return round(min(max(final - 0.05, start + MIN_GAIN), 1.0), 4)


def _mode(summaries: list[RunSummary]) -> ModeComparison:
    """The runs of one mode with the spread of each of ``FIGURES``, in that order."""
    def of(k: Figure) -> Spread:
        return spread([s.get(k) for s in summaries])

    return {"runs": summaries,
            "minutes_to_threshold": of("minutes_to_threshold"),
            "val_success_final": of("val_success_final"),
            "training_minutes": of("training_minutes"),
            "trained_rollouts_per_minute": of("trained_rollouts_per_minute"),
            "sample_age_mean_steps": of("sample_age_mean_steps"),
            "sample_age_max_steps": of("sample_age_max_steps"),
            "carried_over_rollouts_total": of("carried_over_rollouts_total"),
            "carry_over_age_max_steps": of("carry_over_age_max_steps")}


def compare(runs: Runs, threshold: float | None = None) -> Comparison:
    """Runs of each mode (step and evaluation rows per run) summarised against one threshold
    (by default ``default_threshold``)."""
    if threshold is None:
        threshold = default_threshold(runs)
    out: Comparison = {"threshold": threshold, "modes": {}}
    for mode, rs in runs.items():
        out["modes"][mode] = _mode([run_summary(*split_rows(r), threshold) for r in rs])
    a, s = out["modes"].get("async"), out["modes"].get("sync")
    if a and s and a["minutes_to_threshold"]["median"] and s["minutes_to_threshold"]["median"]:
        out["speedup_to_threshold"] = (s["minutes_to_threshold"]["median"]
                                       / a["minutes_to_threshold"]["median"])
    return out


def _cell(fig: Spread) -> str:
    def f(v: float | None) -> str:
        return "never" if v is None else f"{v:.2f}"

    if len(fig["runs"]) == 1:
        return f(fig["runs"][0])
    return f"{f(fig['median'])} ({f(fig['min'])}-{f(fig['max'])})"


def table(result: Comparison) -> str:
    """The comparison as a text table: median (range) of each figure per mode."""
    modes = list(result["modes"])
    width = 24
    head = "figure".ljust(30) + "".join(m.rjust(width) for m in modes)
    lines = [f"held-out success threshold: {result['threshold']}", head, "-" * len(head)]
    for k in FIGURES:
        lines.append(k.ljust(30) + "".join(_cell(result["modes"][m][k]).rjust(width)
                                           for m in modes))
    if "speedup_to_threshold" in result:
        lines.append(f"asynchronous reached the threshold {result['speedup_to_threshold']:.2f}x "
                     "sooner (median minutes of training)")
    return "\n".join(lines)


def plot(result: Comparison, path: str | Path, title: str = "held-out success"
         ) -> str | Path:
    """Held-out success against minutes of training, every run of every mode on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"async": "tab:blue", "sync": "tab:orange"}
    for mode, data in result["modes"].items():
        for i, run in enumerate(data["runs"]):
            xs = [m for m, _ in run["curve"]]
            ys = [s for _, s in run["curve"]]
            ax.plot(xs, ys, "o-", color=colours.get(mode), alpha=0.8,
                    label=f"{mode}" if i == 0 else None)
    if result.get("threshold") is not None:
        ax.axhline(result["threshold"], color="grey", ls=":", label="threshold")
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out success (greedy)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

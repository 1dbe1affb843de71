"""A step's metrics: built here from what the step did, and where they go (a JSONL file, the
console, W&B, offline by default; the driver keeps each entry in Redis too).

The JSONL file and W&B get the same dict each step; every name is documented in
``docs/metrics.md`` and the carry-over metrics keep their documented names exactly. Building
an entry does no IO: the step hands over what it read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sink stays light to import: the collector brings Celery
    from app.config.schema import Config
    from app.driver.collector import Selection

log = logging.getLogger(__name__)

# A step's metrics: names to JSON values (numbers, or null where a figure does not apply;
# the trainer's come through Celery's JSON), read back from Redis as they were written.
Metrics = dict[str, object]

CARRY = "training/async/"
# The carry-over metrics, in the order the console line shows them.
CARRY_METRICS = (
    CARRY + "n_prev_carry_over_rollouts",
    CARRY + "n_completed_rollouts",
    CARRY + "n_new_carry_over_rollouts",
    CARRY + "new_carry_over_age_max_steps",
    CARRY + "proxy_inflight_at_pause",
    CARRY + "proxy_drain_seconds",
)


def step_metrics(trainer: Mapping[str, object], selection: Selection | None, n_groups: int,
                 n: int, counters: dict[str, int], counted_before: dict[str, int], *,
                 waited: float, overdue: float, update_s: float, step_s: float,
                 redis_used_memory: int) -> Metrics:
    """One step's metrics entry, in the order its line shows them: the trainer's, then the
    selection's carry-over figures (none when the step's selection is not known), then what
    the run's counters moved by since ``counted_before`` (what the last entry counted up
    to), the step's timings and Redis's memory. ``n_groups``: the groups the step trained,
    of ``n`` rollouts each; ``overdue``: the part of ``waited`` spent on groups past the
    age cap."""
    metrics: Metrics = dict(trainer)
    if selection is not None:
        metrics.update({
            CARRY + "n_prev_carry_over_rollouts": selection.prev_carry_over_rollouts,
            CARRY + "n_completed_rollouts": n_groups * n,
            CARRY + "n_new_carry_over_rollouts": selection.new_carry_over_rollouts,
            CARRY + "new_carry_over_age_max_steps": selection.carry_over_age_max,
            "training/async/n_carry_over_finished_rollouts":
                selection.carry_over_finished_rollouts,
            "training/async/n_complete_unselected_rollouts":
                selection.complete_unselected_rollouts,
            "training/async/consumed_age_mean_steps": statistics.fmean(selection.consumed_ages),
            "training/async/consumed_age_max_steps": max(selection.consumed_ages),
        })
    delta = {k: counters[k] - counted_before[k] for k in counters}
    if selection is not None:
        # of the complete groups this step's wait saw, the share dynamic sampling filtered
        # (all rewards equal)
        metrics["training/async/filtered_group_share"] = \
            delta["filtered"] / (delta["filtered"] + n_groups)
    metrics.update({
        "training/async/n_dropped_groups": delta["dropped"],
        # counted where pushed: a quarantined prompt's drops are not re-queued
        "training/async/n_requeued_groups": delta["requeued"],
        "training/async/n_cancelled_groups": delta["cancelled"],
        "training/async/n_filtered_groups": delta["filtered"],
        "training/async/n_quarantined_prompts": delta["quarantined"],
        "timing/wait_for_data_seconds": waited,
        "timing/wait_for_overdue_seconds": overdue if selection is not None else 0.0,
        "timing/update_seconds": update_s,
        "timing/step_seconds": step_s,
        "redis/used_memory_bytes": redis_used_memory,
    })
    return metrics


def _clean(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsSink:
    def __init__(self, run_dir: Path, run_id: str, cfg: Config,
                 console: bool = True) -> None:
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = run_dir / "metrics.jsonl"
        self.console = console
        self.wandb_run = None
        _end_cleanly(self.jsonl_path)
        mode = os.environ.get("WANDB_MODE") or cfg.logging.wandb_mode
        if mode != "disabled":
            try:
                import wandb

                # W&B advertises its Weave product whenever an LLM client is imported (the
                # agents import openai): not for a training run's console
                os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
                run = wandb.init(
                    project=cfg.logging.wandb_project, name=run_id, id=run_id, resume="allow",
                    # $WANDB_MODE, when set, is W&B's own to judge
                    dir=str(run_dir), mode=mode,  # type: ignore[arg-type]
                    config=cfg.to_dict(),
                    settings=wandb.Settings(silent=True, console="off"))
                # an evaluation is plotted at the update it measured, not the step that
                # reported it
                run.define_metric("val/*", step_metric="val/sent_at_step")
                self.wandb_run = run
            except Exception as exc:  # noqa: BLE001 - metrics must not stop training
                log.warning("W&B disabled for this run: %s", exc)

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        """One step's line, and its W&B row. Neither stops training when it fails (a full
        disk, W&B's own errors): the metrics are also kept in Redis with the run."""
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        try:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            log.error("step %d's metrics not written to %s: %s", step, self.jsonl_path, exc)
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({k: v for k, v in record.items() if v is not None},
                                   step=step)
            except Exception as exc:  # noqa: BLE001 - metrics must not stop training
                log.warning("W&B disabled for the rest of this run: %s", exc)
                self.wandb_run = None

    def catch_up(self, last_entry: str | None) -> bool:
        """At resume: write the run's last metrics entry kept in Redis (JSON) if the file
        lacks it (the driver died between keeping it and writing it here: nothing else is
        written in between, so only the last can be missing). True if it was written."""
        if last_entry is None:
            return False
        entry = json.loads(last_entry)
        # among the last few, not only the last: an outage's repair may have kept a step's
        # entry again in Redis after an evaluation's line that came later in the file
        if {k: _clean(v) for k, v in entry.items()} in _last_lines(self.jsonl_path, 8):
            return False
        step = entry.pop("step")
        log.info("metrics of step %d were kept in Redis, not in %s: written now", step,
                 self.jsonl_path)
        self.log(step, entry)
        return True

    def close(self) -> None:
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as exc:  # noqa: BLE001 - must not hide how the run ended
                log.warning("W&B run not finished cleanly: %s", exc)

    @property
    def wandb_dir(self) -> str | None:
        return getattr(self.wandb_run, "dir", None) if self.wandb_run else None


def _last_lines(path: Path, n: int) -> list[Metrics]:
    """The file's last ``n`` records, as :meth:`MetricsSink.log` wrote them (non-finite
    values as null)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - (1 << 20)))
            lines = f.read().splitlines()[1 if size > (1 << 20) else 0:]  # whole lines only
    except OSError:
        return []
    return [json.loads(line) for line in lines[-n:]]


def _end_cleanly(path: Path) -> None:
    """A line cut short by a crash (the driver killed mid-write, a full disk) is dropped, so
    that the lines a resumed run appends each stay a line of their own, all readable."""
    try:
        with path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            keep, end = 0, size  # the last newline, read back from the end in pieces
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                at = f.read(end - start).rfind(b"\n")
                if at >= 0:
                    keep = start + at + 1
                    break
                end = start
            f.truncate(keep)
        log.warning("%s ended in a line cut short (%d bytes); dropped", path, size - keep)
    except FileNotFoundError:
        return
    except OSError as exc:  # the metrics must not stop training; the write says it again
        log.warning("cannot check the end of %s: %s", path, exc)


def console_line(step: int, total: int, m: Mapping[str, object]) -> str:
    def g(name: str, fmt: str = "{:.0f}") -> str:
        v = m.get(name)
        return "-" if v is None else fmt.format(v)

    return (f"step {step + 1:>4}/{total} reward {g('reward/mean', '{:.3f}')} "
            f"carry prev/used/new {g(CARRY + 'n_prev_carry_over_rollouts')}/"
            f"{g(CARRY + 'n_completed_rollouts')}/{g(CARRY + 'n_new_carry_over_rollouts')} "
            f"age max {g(CARRY + 'new_carry_over_age_max_steps')} "
            f"stale {g('training/async/consumed_age_mean_steps', '{:.2f}')} "
            f"drain {g(CARRY + 'proxy_drain_seconds', '{:.2f}')}s "
            f"step {g('timing/step_seconds', '{:.1f}')}s")


def val_line(step: int, m: Mapping[str, float]) -> str:
    lo, hi = int(m["val/policy_version_min"]), int(m["val/policy_version_max"])
    versions = f"v{lo}" if lo == hi else f"v{lo}-v{hi}"
    return (f"eval sent after {m['val/sent_at_step']:.0f} updates (policy {versions}): "
            f"success {m['val/success_rate']:.3f} reward {m['val/reward_mean']:.3f} over "
            f"{m['val/n_rollouts']:.0f} rollouts ({m['val/seconds']:.0f} s)")

"""The driver's collection loop without a trainer: top up, wait, select, repeat.

What the ``overhead`` and ``scale`` benchmarks time: the same ``Collector`` calls as
``app.driver.step`` (a step's top-up, collection and selection), with the update left
out, so what remains is orchestration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.config.schema import Config
from app.driver.collector import Collector
from app.state import keys


@dataclass
class CollectRun:
    run_id: str
    fill_s: float                                        # first top-up (the whole pool)
    top_up_s: list[float] = field(default_factory=list)  # per step: dispatching replacements
    select_s: list[float] = field(default_factory=list)  # per step: the selection transaction
    wait_s: list[float] = field(default_factory=list)    # per step: waiting for ready groups
    step_ends: list[float] = field(default_factory=list)  # epoch seconds
    selected: list[list[str]] = field(default_factory=list)


def start_run(client: Any, cfg: Config, run_id: str) -> tuple[Collector, CollectRun]:
    """Create the run and fill its pool (timed as ``fill_s``)."""
    Collector.create_run(client, run_id, cfg.to_dict(),
                         "async" if cfg.agentlightning.async_rollout.enabled else "sync")
    collector = Collector(client, run_id, cfg)
    t = time.perf_counter()
    collector.top_up(0)
    return collector, CollectRun(run_id=run_id, fill_s=time.perf_counter() - t)


def run_steps(collector: Collector, out: CollectRun, steps: int) -> CollectRun:
    start = len(out.selected)
    for step in range(start, start + steps):
        waited = collector.wait_ready()
        t = time.perf_counter()
        selection = collector.select(step, collector.active_count(), waited)
        collector.set_step(step + 1)
        t1 = time.perf_counter()
        collector.top_up(0, dispatch_step=step + 1)
        t2 = time.perf_counter()
        out.select_s.append(t1 - t)
        out.top_up_s.append(t2 - t1)
        out.wait_s.append(waited)
        out.step_ends.append(time.time())
        out.selected.append(selection.group_ids)
    return out


def collect(client: Any, cfg: Any, run_id: str, steps: int) -> CollectRun:
    collector, out = start_run(client, cfg, run_id)
    return run_steps(collector, out, steps)


def group_latencies(client: Any, group_ids: list[str]) -> dict[str, list[float]]:
    """Seconds from dispatch and from completion to selection, per selected group."""
    pipe = client.pipeline(transaction=False)
    for gid in group_ids:
        pipe.hmget(keys.group(gid), "dispatched_at", "completed_at", "selected_at")
    rows = pipe.execute()
    out: dict[str, list[float]] = {"dispatch_to_selected": [], "completed_to_selected": []}
    for dispatched, completed, selected in rows:
        if not (dispatched and completed and selected):
            continue
        out["dispatch_to_selected"].append(float(selected) - float(dispatched))
        out["completed_to_selected"].append(float(selected) - float(completed))
    return out

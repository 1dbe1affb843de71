"""A rollout host partitioned from every other host for good, on the multi-host harness
(bench/multihost.py): its link is set down mid-run, at a moment it holds siblings it has not
acknowledged, and never set up again. The run goes on without it: the siblings it held are
requeued to the other rollout host (its reaper, once the cut host's alive key expired), each
group trains once and whole, the groups whose siblings were requeued among them, and the
run finishes STEPS_AFTER_REQUEUE steps after the requeue.

It prints how long the run stalled (the longest wait between two steps after the cut, beside
the ordinary step's) and what was redone (the siblings requeued, the groups they belong to)."""

from __future__ import annotations

import datetime
import json
import re
import statistics
import subprocess
import time

import pytest

from bench.multihost import BIN, Cluster
from tests.multihost import (
    CUT_PROBE,
    RUN_TIMEOUT_S,
    SMALL_RUN,
    TEST_TIMEOUT_S,
    metrics_rows,
    multihost,  # noqa: F401 - fixture
    probe_answer,
    run_id_of,
    run_state,
    start_driver,
    stop_session,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

CUT_AFTER_STEP = 5
# steps done after roll2 logged the requeue before the run stops: the requeued siblings'
# groups are oldest, so they train in the first steps after their siblings ran again
STEPS_AFTER_REQUEUE = 8
MAX_STEPS = 100_000  # a ceiling only: the test stops the run, RUN_TIMEOUT_S bounds it
BUSY_WAIT_S = 180.0
CUT_TRIES = 3
REQUEUE = re.compile(r"^\[([\d-]+ [\d:,]+): .*rollout worker roll1:\S+ died: requeued its task",
                     re.MULTILINE)




def _requeues(cluster: Cluster) -> list[datetime.datetime]:
    """When roll2's reaper requeued a task of roll1's (the hosts log in UTC)."""
    logs = "".join(cluster.log("roll2", role).read_text(errors="replace")
                   for role in ("rollout", "groups"))
    return [datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            .replace(tzinfo=datetime.UTC) for m in REQUEUE.finditer(logs)]


def test_rollout_host_partitioned_for_good(multihost, record_property):  # noqa: F811
    python = str(BIN / "python")
    driver = start_driver(multihost, f"trainer.total_steps={MAX_STEPS}", *SMALL_RUN)
    probe: subprocess.Popen | None = None
    requeued_at: float | None = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        with open(multihost.log("trainer", "cut-probe"), "ab") as errors:
            probe = multihost.popen("trainer", [python, "-c", CUT_PROBE, "roll1",
                                                str(BUSY_WAIT_S)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=errors, text=True)
        probe_answer(probe, None, ("ready",))
        while len(driver.steps()) < CUT_AFTER_STEP:
            assert driver.proc.poll() is None, f"the run ended early:\n{driver.text()}"
            assert time.monotonic() < deadline, f"no step {CUT_AFTER_STEP}:\n{driver.text()}"
            time.sleep(0.2)
        # cut while roll1 runs siblings; should every one it held have ended in the instant
        # before the cut, it is let back (at once, before its alive key could expire) and
        # cut again: the last cut is for good
        held: list = []
        for _ in range(CUT_TRIES):
            busy = probe_answer(probe, "wait", ("busy", "idle"))
            assert busy.startswith("busy"), \
                f"roll1's rollout worker ran no task in {BUSY_WAIT_S:.0f} s:\n{driver.text()}"
            multihost.cut("roll1")
            cut_at, cut_wall = time.monotonic(), datetime.datetime.now(datetime.UTC)
            held = json.loads(probe_answer(probe, "held", ("held",)).split(" ", 1)[1])
            if held:
                break
            multihost.heal("roll1")
        stop_session(probe)
        assert held, f"roll1 held no unacknowledged task at any of {CUT_TRIES} cuts"
        # the run goes on: roll2 requeues roll1's siblings, and STEPS_AFTER_REQUEUE steps on
        while requeued_at is None or len(
                [t for t, _ in driver.steps() if t > requeued_at]) < STEPS_AFTER_REQUEUE:
            assert driver.proc.poll() is None, f"the run ended:\n{driver.text()}"
            assert time.monotonic() < deadline, (
                f"in {RUN_TIMEOUT_S:.0f} s of the start, "
                + ("roll2 requeued none of roll1's tasks" if requeued_at is None else
                   f"the run did not go {STEPS_AFTER_REQUEUE} steps past the requeue")
                + f":\n{driver.text()}\n" + multihost.tails(["roll2", "trainer"]))
            if requeued_at is None and _requeues(multihost):
                requeued_at = time.monotonic()
            time.sleep(0.5)
        driver.stop(deadline, driver.text, within_s=RUN_TIMEOUT_S)
    finally:
        driver.kill()
        if probe is not None:
            stop_session(probe)
        driver.thread.join(10)
    assert multihost.link_up("roll1") is False, "roll1 was let back in"
    assert driver.proc.returncode == 0, \
        f"the driver exited {driver.proc.returncode}:\n{driver.text()}\n" \
        + multihost.tails(["roll2", "trainer"])
    assert run_id_of(driver.text()) == driver.run_id
    done = driver.steps()
    steps = len(done)
    assert [s for _, s in done] == list(range(1, steps + 1))

    state = run_state(multihost, driver.run_id, steps, gone={"rollout@roll1", "groups@roll1"})
    assert state["run"].get("status") == "finished", state["run"]
    trained = [g for s in range(steps) for g in state["steps"][str(s)]]
    assert [len(state["steps"][str(s)]) for s in range(steps)] == [2] * steps, state["steps"]
    assert len(set(trained)) == len(trained), f"trained twice: {trained}"
    for step in range(steps):
        for gid in state["steps"][str(step)]:
            group = state["groups"][gid]
            assert group["trained"] == str(step), (gid, step, group)
            assert len(group["results"]) == 4 and set(group["results"]) == {"ok"}, (gid, group)
    rows = metrics_rows(multihost, driver.run_id)
    assert [r["step"] for r in rows] == list(range(steps))
    assert sum(r["training/async/n_dropped_groups"] for r in rows) == 0, rows
    # what roll1 held was redone elsewhere: each sibling's group trained whole
    held_groups = {args[0] for task, args in held if task.endswith(".run_rollout")}
    assert held_groups <= set(trained), (
        f"groups of siblings roll1 held at the cut that never trained: "
        f"{sorted(held_groups - set(trained))}")
    requeues = _requeues(multihost)
    assert len(requeues) >= len(held), (len(requeues), held)
    assert state["tasks"].get("rollout@roll2", {}).get("workers.rollout.tasks.run_rollout")

    gaps = [(a, b) for (a, _), (b, _) in zip(done, done[1:], strict=False)]
    ordinary = statistics.median(b - a for a, b in gaps if b <= cut_at)
    after_cut = [t for t, _ in done if t > cut_at]
    stall = max([after_cut[0] - cut_at,
                 *(b - a for a, b in gaps if a > cut_at)])
    requeue_s = (min(requeues) - cut_wall).total_seconds()
    trained_at = {gid: int(s) for s, gids in state["steps"].items() for gid in gids}
    summary = (f"ordinary wait between steps {ordinary:.1f} s (median before the cut); "
               f"first step {after_cut[0] - cut_at:.1f} s after the cut, longest wait after "
               f"it {stall:.1f} s; roll1 held {len(held)} unacknowledged ({len(held_groups)} "
               f"groups), requeued by roll2 {requeue_s:.1f} s after the cut ({len(requeues)} "
               f"requeued); those groups trained at steps "
               f"{sorted(trained_at[g] for g in held_groups)} (cut after step "
               f"{len(done) - len(after_cut)}); {len(after_cut)} steps after the cut, "
               f"{steps} in all")
    print(summary)
    record_property("rollout_host_lost", summary)

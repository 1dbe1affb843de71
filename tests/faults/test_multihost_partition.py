"""A rollout host partitioned from every other host for longer than a step, then healed, on
the multi-host harness (bench/multihost.py): its link is set down mid-run, while it runs
siblings. Its siblings are redelivered to the other rollout host (the reaper, once its alive
key expired) or resumed by it after the heal; each group trains once and whole, the run
goes on to its last step, and the host serves again. The test prints how long the run
stalled: the longest wait between two steps across the partition, beside the ordinary
step's."""

from __future__ import annotations

import datetime
import os
import re
import statistics
import subprocess
import threading
import time

import pytest

from tests.multihost import (
    RUN_TIMEOUT_S,
    SMALL_RUN,
    assert_trained_once_and_whole,
    metrics_rows,
    multihost,  # noqa: F401 - fixture
    run_id_of,
    run_state,
)

pytestmark = pytest.mark.slow

# longer than a step and than services.worker_heartbeat_s (15 s), after which the other
# rollout host's reaper takes the cut host's unacknowledged siblings
PARTITION_S = float(os.environ.get("CARRYOVER_MH_PARTITION_S", "45"))
# enough steps that some are left after the heal (a step takes about a second here)
STEPS = 60 + int(2 * max(PARTITION_S - 45, 0))
CUT_AFTER_STEP = 5
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)")


def test_rollout_host_partitioned_then_healed(multihost, record_property):  # noqa: F811
    train = multihost.popen("trainer", ["carryover", "train", f"trainer.total_steps={STEPS}",
                                        *SMALL_RUN],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert train.stdout is not None
        for line in train.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def steps_done() -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in list(lines)
                if (m := STEP_LINE.match(line))]

    def output() -> str:
        return "\n".join(line for _, line in lines)[-4000:]

    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(steps_done()) < CUT_AFTER_STEP:
            assert train.poll() is None, f"the run ended early:\n{output()}"
            assert time.monotonic() < deadline, f"no step {CUT_AFTER_STEP}:\n{output()}"
            time.sleep(0.2)
        multihost.cut("roll1")
        cut_at, cut_wall = time.monotonic(), datetime.datetime.now()
        try:
            while time.monotonic() - cut_at < PARTITION_S:
                assert train.poll() is None, f"the run ended in the partition:\n{output()}"
                time.sleep(0.5)
        finally:
            multihost.heal("roll1")
        healed_at = time.monotonic()
        # the healed host's workers answer again (their broker connection came back)
        back = None
        while back is None and time.monotonic() - healed_at < 300:
            nodes = multihost.health().get("nodes", [])
            if {"rollout@roll1", "groups@roll1"} <= set(nodes):
                back = time.monotonic() - healed_at
        train.wait(max(deadline - time.monotonic(), 1))
    finally:
        if train.poll() is None:
            os.killpg(train.pid, 9)
        reader.join(10)
    assert train.returncode == 0, f"carryover train exited {train.returncode}:\n{output()}\n" \
        + multihost.tails(["roll1", "roll2", "trainer"])
    run_id = run_id_of(output())
    done = steps_done()
    assert [s for _, s in done] == list(range(1, STEPS + 1))
    before = [t for t, s in done if t <= cut_at]
    after_heal = [s for t, s in done if t > healed_at]
    assert after_heal, f"the run ended within the partition; raise STEPS:\n{output()}"
    assert back is not None, "the healed rollout host's workers never answered again"

    state = run_state(multihost, run_id, STEPS)
    assert_trained_once_and_whole(state, STEPS, per_step=2, n=4)
    rows = metrics_rows(multihost, run_id)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert sum(r["training/async/n_dropped_groups"] for r in rows) == 0, rows
    logs = "".join(multihost.log("roll2", role).read_text(errors="replace")
                   for role in ("rollout", "groups"))
    requeues = [datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                for m in re.finditer(r"^\[([\d-]+ [\d:,]+): .*rollout worker roll1:\S+ "
                                     r"died: requeued its task", logs, re.MULTILINE)]
    # the cut host held siblings: they were taken up by the other host
    assert requeues, "none of roll1's tasks was requeued:\n" + multihost.tails(["roll2"])

    # the stall: the longest wait between two steps in the partition and after it, against
    # an ordinary one (the demo's tool has a heavy tail: an ordinary wait can be long too)
    gaps = [(a, b) for (a, _), (b, _) in zip(done, done[1:], strict=False)]
    ordinary = statistics.median(b - a for a, b in gaps if b <= cut_at)
    in_cut = max(b - max(a, cut_at) for a, b in gaps if b > cut_at and a <= healed_at)
    after = max((b - a for a, b in gaps if a > healed_at), default=0.0)
    first_after_cut = done[len(before)][0] - cut_at
    requeued_after = (min(requeues) - cut_wall).total_seconds()
    summary = (f"partition {PARTITION_S:.0f} s: ordinary wait between steps {ordinary:.1f} s "
               f"(median before the cut); the first step {first_after_cut:.1f} s after the "
               f"cut; longest wait in the partition {in_cut:.1f} s, after the heal "
               f"{after:.1f} s; {sum(1 for t, _ in done if cut_at < t <= healed_at)} steps in "
               f"the partition, {len(after_heal)} after it; roll1's tasks requeued by roll2 "
               f"{requeued_after:.1f} s after the cut ({len(requeues)}); roll1's workers "
               f"answered {back:.1f} s after the heal")
    print(summary)
    record_property("partition", summary)
    tasks = state["tasks"]
    assert tasks.get("rollout@roll2", {}).get("workers.rollout.tasks.run_rollout"), tasks

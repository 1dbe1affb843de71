"""A rollout host partitioned from every other host for longer than a step, then healed, on
the multi-host harness (bench/multihost.py): its link is set down mid-run, at a moment it
holds siblings it has not acknowledged. Those are requeued to the other rollout host (the
reaper, once its alive key expired); each group trains once and whole, the run goes on, the
healed host's workers answer again and it runs siblings of later steps that are trained.

The test decides when the run ends, whatever a step's speed: the driver stops (its
``should_stop``) once the healed host ran a sibling and STEPS_AFTER_HEAL more steps are done.
It prints how long the run stalled: the longest wait between two steps across the partition,
beside the ordinary step's."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import time

import pytest

from bench.multihost import BIN, HarnessError
from tests.multihost import (
    CUT_PROBE,
    RUN_TIMEOUT_S,
    SMALL_RUN,
    STEP_LINE,
    TEST_TIMEOUT_S,
    assert_trained_once_and_whole,
    metrics_rows,
    multihost,  # noqa: F401 - fixture
    probe_answer,
    run_id_of,
    run_state,
    start_driver,
)
from tests.multihost import Lines as _Lines
from tests.multihost import stop_session as _stop_session

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

# longer than a step and than services.worker_heartbeat_s (15 s), after which the other
# rollout host's reaper takes the cut host's unacknowledged siblings
PARTITION_S = float(os.environ.get("CARRYOVER_MH_PARTITION_S", "45"))
# a ceiling only: the test stops the run (below), RUN_TIMEOUT_S bounds it
MAX_STEPS = 100_000
CUT_AFTER_STEP = 5
# steps done after the healed host was first seen running a sibling, before the run stops:
# that sibling's group, and those after it, are trained by then
STEPS_AFTER_HEAL = 6
# how long the cut waits for the host to be running a sibling, and how often it cuts again
# when the siblings it held all ended at the very moment of the cut
BUSY_WAIT_S = 180.0
CUT_TRIES = 3
HEAL_WAIT_S = 300.0

# On the trainer host: prints the id of each attempt of run argv[1] that a worker of host
# argv[2] started after argv[3] (epoch seconds), as it appears, for argv[4] seconds. An
# attempt's record lives until its group is trained, so it is looked for as it runs.
_ATTEMPTS = """
import sys, time
import redis
from app.config import service_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
run_id, host, since, wait_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
text = lambda v: v.decode() if isinstance(v, bytes) else v
c = connect(resolve_redis_url(service_config()))
prefix, seen = keys.rollout(""), set()
deadline = time.monotonic() + wait_s
while time.monotonic() < deadline:
    for key in map(text, c.scan_iter(match=prefix + "*", count=1000)):
        rid = key[len(prefix):]
        if rid in seen or key.endswith((":calls", ":turns", ":leases")):
            continue
        try:
            run, worker, created = map(text, c.hmget(key, "run_id", "worker", "created_at"))
        except redis.ResponseError:  # not a rollout record's hash
            continue
        if run == run_id and (worker or "").startswith(host + ":") \\
                and float(created or 0) > since:
            seen.add(rid)
            print(rid, flush=True)
    time.sleep(0.2)
"""


def test_rollout_host_partitioned_then_healed(multihost, record_property):  # noqa: F811
    python = str(BIN / "python")
    driver = start_driver(multihost, f"trainer.total_steps={MAX_STEPS}", *SMALL_RUN)
    probe_log = multihost.log("trainer", "cut-probe")
    attempts_log = multihost.log("trainer", "attempts")
    procs: list[subprocess.Popen] = []

    def steps_done() -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in list(driver.lines)
                if (m := STEP_LINE.match(line))]

    def output() -> str:
        return driver.text()

    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        with open(probe_log, "ab") as errors:
            probe = multihost.popen("trainer", [python, "-c", CUT_PROBE, "roll1",
                                                str(BUSY_WAIT_S)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=errors, text=True)
        procs.append(probe)
        probe_answer(probe, None, ("ready",))
        while len(steps_done()) < CUT_AFTER_STEP:
            assert driver.proc.poll() is None, f"the run ended early:\n{output()}"
            assert time.monotonic() < deadline, f"no step {CUT_AFTER_STEP}:\n{output()}"
            time.sleep(0.2)
        # cut while roll1 runs siblings, and again should every one it held have ended
        # (acknowledged) in the instant before the cut
        held = 0
        for _ in range(CUT_TRIES):
            busy = probe_answer(probe, "wait", ("busy", "idle"))
            assert busy.startswith("busy"), \
                f"roll1's rollout worker ran no task in {BUSY_WAIT_S:.0f} s:\n{output()}"
            multihost.cut("roll1")
            cut_at, cut_wall = time.monotonic(), datetime.datetime.now(datetime.UTC)
            held = len(json.loads(probe_answer(probe, "held", ("held",)).split(" ", 1)[1]))
            if held:
                break
            multihost.heal("roll1")
        _stop_session(probe)
        try:
            assert held, f"roll1 held no unacknowledged task at any of {CUT_TRIES} cuts"
            while time.monotonic() - cut_at < PARTITION_S:
                assert driver.proc.poll() is None, f"the run ended in the partition:\n{output()}"
                time.sleep(0.5)
        finally:
            multihost.heal("roll1")
        healed_at, healed_epoch = time.monotonic(), time.time()
        # the healed host's workers answer again (their broker connection came back); a
        # look that fails (a timeout under load) is "not yet"
        back = None
        last_look = ""
        while back is None and time.monotonic() - healed_at < HEAL_WAIT_S:
            try:
                seen = multihost.health(timeout=60)
            except HarnessError as exc:
                last_look = str(exc)[-500:]
            else:
                last_look = str(seen)
                if {"rollout@roll1", "groups@roll1"} <= set(seen.get("nodes", [])):
                    back = time.monotonic() - healed_at
                    break
            time.sleep(2)
        assert back is not None, \
            f"roll1's workers did not answer in {HEAL_WAIT_S:.0f} s of the heal: {last_look}"
        # roll1 runs siblings again: the run goes on until one it started after the heal
        # is seen, and STEPS_AFTER_HEAL steps more
        with open(attempts_log, "ab") as errors:
            watch = multihost.popen("trainer", [python, "-c", _ATTEMPTS, driver.run_id, "roll1",
                                                str(healed_epoch),
                                                str(max(deadline - time.monotonic(), 1))],
                                    stdout=subprocess.PIPE, stderr=errors, text=True)
        procs.append(watch)
        assert watch.stdout is not None
        roll1_attempts = _Lines(watch.stdout)
        while not roll1_attempts.lines or len(
                [t for t, _ in steps_done() if t > roll1_attempts.lines[0][0]]) \
                < STEPS_AFTER_HEAL:
            assert driver.proc.poll() is None, f"the run ended:\n{output()}"
            assert time.monotonic() < deadline, (
                f"in {RUN_TIMEOUT_S:.0f} s of the start, roll1 ran "
                f"{len(roll1_attempts.lines)} siblings after the heal and the run did not "
                f"go {STEPS_AFTER_HEAL} steps past the first:\n{output()}\n"
                + multihost.tails(["roll1"]))
            time.sleep(0.5)
        driver.stop(deadline, output, within_s=RUN_TIMEOUT_S)
    finally:
        driver.kill()
        for proc in procs:
            _stop_session(proc)
        driver.thread.join(10)
    assert driver.proc.returncode == 0, \
        f"the driver exited {driver.proc.returncode}:\n{output()}\n" \
        + multihost.tails(["roll1", "roll2", "trainer"])
    assert run_id_of(output()) == driver.run_id
    done = steps_done()
    steps = len(done)
    assert [s for _, s in done] == list(range(1, steps + 1))
    before = [t for t, s in done if t <= cut_at]
    after_heal = [s for t, s in done if t > healed_at]
    assert len(after_heal) >= STEPS_AFTER_HEAL, output()

    state = run_state(multihost, driver.run_id, steps)
    assert state["run"].get("status") == "finished", state["run"]
    assert_trained_once_and_whole(state, steps, per_step=2, n=4)
    rows = metrics_rows(multihost, driver.run_id)
    assert [r["step"] for r in rows] == list(range(steps))
    assert sum(r["training/async/n_dropped_groups"] for r in rows) == 0, rows
    # a sibling roll1 ran after the heal belongs to a group trained whole
    trained_rollouts = {rid for g in state["groups"].values() for rid in g["rollouts"]}
    ran_after_heal = {line for _, line in roll1_attempts.lines}
    assert ran_after_heal & trained_rollouts, (
        f"none of the {len(ran_after_heal)} siblings roll1 started after the heal was "
        f"trained: {sorted(ran_after_heal)[:10]}")

    logs = "".join(multihost.log("roll2", role).read_text(errors="replace")
                   for role in ("rollout", "groups"))
    # the hosts' processes log in UTC (bench.multihost: TZ=UTC), as cut_wall is taken
    requeues = [datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                .replace(tzinfo=datetime.UTC)
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
               f"the partition, {len(after_heal)} after it; roll1 held {held} unacknowledged "
               f"at the cut, requeued by roll2 {requeued_after:.1f} s after it "
               f"({len(requeues)}); roll1's workers answered {back:.1f} s after the heal, "
               f"its first sibling after the heal started "
               f"{roll1_attempts.lines[0][0] - healed_at:.1f} s after it (seen), "
               f"{len(ran_after_heal)} in all; {steps} steps")
    print(summary)
    record_property("partition", summary)
    tasks = state["tasks"]
    assert tasks.get("rollout@roll2", {}).get("workers.rollout.tasks.run_rollout"), tasks

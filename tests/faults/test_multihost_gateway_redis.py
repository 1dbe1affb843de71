"""The gateway's host partitioned from Redis only, on the multi-host harness
(bench/multihost.py): it still reaches the inference server beside it, and the rollout hosts
still reach it; then healed.

Without Redis the gateway can check neither a caller's token nor the pause nor a lease, so it
must not forward a call: a program on a rollout host calls it every few seconds, and each
call made in the partition must be answered within ANSWER_BOUND_S by a retryable 503 with an
OpenAI-style error body and ``Retry-After`` (not held until the network heals). No call whose
lease the gateway could not keep alive may be recorded: a call started before the cut that
reaches Redis only after it. After the heal the gateway answers from Redis again, the run goes
on, and every group trains once and whole. The test prints how long the run stalled and what
was done again (attempts retried, calls answered 503)."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import time

import pytest

from bench.multihost import BIN
from tests.multihost import (
    RUN_TIMEOUT_S,
    SMALL_RUN,
    TEST_TIMEOUT_S,
    Lines,
    assert_trained_once_and_whole,
    metrics_rows,
    multihost,  # noqa: F401 - fixture
    run_id_of,
    run_state,
    stall,
    start_driver,
    stop_session,
    warm_inference,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

# longer than the gateway's leases (gateway.lease_ttl_s, 30 s), a drain's timeout (30 s)
# and ANSWER_BOUND_S, so that a call held until the heal waits past that bound
PARTITION_S = float(os.environ.get("CARRYOVER_MH_PARTITION_S", "90"))
MAX_STEPS = 100_000  # a ceiling only: the test stops the run
CUT_AFTER_STEP = 4
STEPS_AFTER_HEAL = 4
# how long a call to the cut gateway may wait for its answer: past the gateway's own bounds
# on a Redis command and a reconnect (10 s each; the admission connection may be busy with
# the lease keeper's command first), with room for a loaded machine
ANSWER_BOUND_S = 60.0
# after the heal, a write sent before it may still arrive: TCP's retransmission backoff
LATE_RECORD_S = 40.0

# On a rollout host: a call to the gateway for a rollout that does not exist, one at a time,
# each START_EVERY s, until stdin closes; prints one JSON line per answer: when it was sent
# and answered (time.monotonic()), its status, Retry-After and error body.
_CALLER = """
import json, sys, threading, time
import httpx
url, every = sys.argv[1], float(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
client = httpx.Client(timeout=300)
while not done.is_set():
    sent = time.monotonic()
    try:
        r = client.post(url + "/rollout/no-such-rollout/v1/chat/completions",
                        headers={"Authorization": "Bearer not-a-token"},
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        try:
            body = r.json()
        except ValueError:
            body = r.text[:200]
        out = {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
               "body": body}
    except httpx.HTTPError as exc:
        out = {"status": None, "error": repr(exc)}
    print(json.dumps({"sent": sent, "answered": time.monotonic(), **out}), flush=True)
    done.wait(max(every - (time.monotonic() - sent), 0))
"""

# On the trainer host (which reaches Redis): each rollout's captured calls, as
# {calls key: [[started_at, ended_at], ...]}.
_CALLS = """
import json
from app.config import service_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
c = connect(resolve_redis_url(service_config()))
out = {}
for key in c.scan_iter(match=keys.rollout_calls("*"), count=1000):
    out[key] = [[v["started_at"], v["ended_at"]] for v in map(json.loads, c.lrange(key, 0, -1))]
print(json.dumps(out))
"""
START_EVERY_S = 3.0


def test_gateway_cut_from_redis(multihost, record_property):  # noqa: F811
    python = str(BIN / "python")
    warm_inference(multihost)
    rollout_logs = {h: multihost.log(h, "rollout") for h in ("roll1", "roll2")}
    logs_at_start = {h: p.stat().st_size for h, p in rollout_logs.items()}
    driver = start_driver(multihost, f"trainer.total_steps={MAX_STEPS}", *SMALL_RUN)
    caller: subprocess.Popen | None = None

    def output() -> str:
        return driver.text() + "\n" + multihost.tails(["infer", "trainer"])

    def wait_steps(n: int, deadline: float) -> None:
        while len(driver.steps()) < n:
            assert driver.proc.poll() is None, f"the run ended early:\n{output()}"
            assert time.monotonic() < deadline, f"no step {n}:\n{output()}"
            time.sleep(0.2)

    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        wait_steps(CUT_AFTER_STEP, deadline)
        with open(multihost.log("roll2", "caller"), "ab") as errors:
            caller = multihost.popen("roll2", [python, "-c", _CALLER, multihost.gateway_url,
                                               str(START_EVERY_S)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=errors, text=True)
        assert caller.stdout is not None
        calls = Lines(caller.stdout)
        while not calls.lines:
            assert time.monotonic() < deadline, "the caller got no answer before the cut"
            time.sleep(0.2)
        multihost.cut_pair("infer", "redis")
        cut_at, cut_wall = time.monotonic(), time.time()
        try:
            at_cut = multihost.python("trainer", _CALLS)
            while time.monotonic() - cut_at < PARTITION_S:
                assert driver.proc.poll() is None, \
                    f"the driver exited in the partition:\n{output()}"
                time.sleep(0.5)
        finally:
            multihost.heal_pair("infer", "redis")
        healed_at = time.monotonic()
        time.sleep(LATE_RECORD_S)
        after_heal = multihost.python("trainer", _CALLS)
        while len([t for t, _ in driver.steps() if t > healed_at]) < STEPS_AFTER_HEAL:
            assert driver.proc.poll() is None, f"the run ended after the heal:\n{output()}"
            assert time.monotonic() < deadline, (
                f"the run did not go {STEPS_AFTER_HEAL} steps past the heal in "
                f"{RUN_TIMEOUT_S:.0f} s of its start:\n{output()}")
            time.sleep(0.5)
        driver.stop(deadline, output)
    finally:
        multihost.heal_pair("infer", "redis")
        driver.kill()
        if caller is not None:
            stop_session(caller)
        driver.thread.join(10)
    assert driver.proc.returncode == 0, f"the driver exited {driver.proc.returncode}:\n{output()}"
    assert run_id_of(driver.text()) == driver.run_id

    # the calls made in the partition: each answered in time, a retryable 503 in OpenAI's
    # shape; before the cut and after the heal the gateway reads Redis (unknown rollout)
    answers = [json.loads(line) for _, line in calls.lines]
    during = [a for a in answers if cut_at + 1 < a["sent"] < healed_at - ANSWER_BOUND_S]
    assert during, f"no call made in the partition: {answers}"
    slow = [round(a["answered"] - a["sent"], 1) for a in during
            if a["answered"] - a["sent"] > ANSWER_BOUND_S]
    assert not slow, (f"calls to the cut gateway waited {slow} s for an answer (more than "
                      f"{ANSWER_BOUND_S:.0f} s): {during}")
    for a in during:
        assert a["status"] == 503 and a["retry_after"], a
        error = a["body"]["error"]
        assert error["type"] == "server_error" and error["message"] and error["code"], a
    assert answers[0]["status"] == 404, answers[0]
    after = [a for a in answers if a["sent"] > healed_at]
    assert after and after[-1]["status"] == 404, after

    # nothing recorded for a lease the gateway could not keep: no call started before the
    # cut that was not in Redis at the cut is there after the heal
    late = {key: [c for c in found if c[0] < cut_wall and c not in at_cut.get(key, [])]
            for key, found in after_heal.items()}
    late = {key: found for key, found in late.items() if found}
    assert not late, f"calls recorded after the heal for leases taken before the cut: {late}"

    done = driver.steps()
    steps = len(done)
    assert [s for _, s in done] == list(range(1, steps + 1)), output()
    state = run_state(multihost, driver.run_id, steps)
    assert state["run"].get("status") == "finished", state["run"]
    assert_trained_once_and_whole(state, steps, per_step=2, n=4)
    rows = metrics_rows(multihost, driver.run_id)
    assert [r["step"] for r in rows] == list(range(steps))
    assert sum(r["training/async/n_dropped_groups"] for r in rows) == 0, rows

    said = "".join(p.read_text(errors="replace")[logs_at_start[h]:]
                   for h, p in rollout_logs.items())
    failed_attempts = len(re.findall(r"rollout \S+ attempt \d+/\d+ failed", said))
    waits = [round(a["answered"] - a["sent"], 1) for a in during]
    ordinary, across, after_wait = stall(done, cut_at, healed_at)
    summary = (f"gateway cut from Redis {PARTITION_S:.0f} s: {len(during)} calls in the "
               f"partition, all 503 with Retry-After, answered in {min(waits)}-{max(waits)} s; "
               f"{sum(map(len, at_cut.values()))} calls in Redis at the cut, none recorded late; "
               f"{failed_attempts} agent attempts failed and retried; ordinary wait "
               f"between steps {ordinary:.1f} s, longest across the fault {across:.1f} s, after "
               f"the heal {after_wait:.1f} s; {steps} steps; cut at "
               f"{datetime.datetime.fromtimestamp(cut_wall, datetime.UTC):%H:%M:%S} UTC")
    print(summary)
    record_property("gateway_partition", summary)

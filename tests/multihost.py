"""The multi-host stack (``bench/multihost.py``) as a pytest fixture, and what its tests read
of a run from inside it: the test process lives in the root namespace, which reaches none
of the hosts, so every look at Redis or Celery runs as a short program on the trainer host.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import pytest

from bench.multihost import (
    BIN,
    START_TIMEOUT_S,
    Cluster,
    HarnessError,
    missing_capability,
    namespaces,
    stack_prefixes,
)

# Set to 1 to skip the multi-host tests on a machine that can make network namespaces.
SKIP_ENV = "CARRYOVER_SKIP_MULTIHOST"
# one session's stack apart from another's and from one started by hand (co-)
PREFIX = f"co-t{os.getpid()}-"
STALE = re.compile(r"^co-t(\d+)-$")
RUN_TIMEOUT_S = float(os.environ.get("CARRYOVER_MH_RUN_TIMEOUT_S", "1200"))
# pytest-timeout's limit for a multi-host test (its fixture's `up` and `down` included, which
# the first and last test of a module pay): past the harness's own limits, so that one of
# those (CARRYOVER_MH_START_TIMEOUT_S, CARRYOVER_MH_RUN_TIMEOUT_S) fails first, naming what
# was slow. The rest covers what those do not bound: up's last health look (up to 120 s),
# the wait for a healed host (300 s), the look at the run (run_state, up to 390 s) and the
# stop of every role (20 s of grace and 10 of SIGKILL per host).
TEST_TIMEOUT_S = START_TIMEOUT_S + RUN_TIMEOUT_S + 1200
# how long the looks at a run's Celery nodes ask again for those that have not answered
STATS_BOUND_S = 90.0
# the demo task, small: 2 groups of 4 per update, 4 in flight (as tests/integration/test_demo)
SMALL_RUN = ("data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
             "agentlightning.async_rollout.async_train_batch_size=4")


@pytest.fixture(scope="module")
def multihost(tmp_root: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A stack spread over network namespaces, one per host, for one test module: up before
    its first test, torn down after its last, also when a test failed (its logs stay under
    the session's temp directory). Leftovers of a crashed test session (namespaces named
    ``co-t<pid>-*`` of a pid no longer running) are cleared first.

    A machine that cannot make them (not root, no ``ip`` or ``unshare``, no Linux bridge)
    skips the tests with what it lacks, named in the skip reason, which pytest's summary
    (``-ra``, on by default here) prints at the end of every run: the multi-host path is then
    plainly untested, not passed. A skip rather than a failure, because such a machine (an
    unprivileged container) can still run every other test. ``$CARRYOVER_SKIP_MULTIHOST=1``
    skips them where they could run."""
    yield from _stack(tmp_root, request)


@pytest.fixture(scope="module")
def multihost_infer2(tmp_root: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """``multihost`` with a second inference server on a host of its own (``infer2``, named
    in ``inference.urls`` beside the first) and the gateway's access log. A drain waits up
    to 120 s (``gateway.drain_timeout_s``) for the calls in flight: a call hung on a cut
    server is then ended by the gateway's own health check or not for minutes, so a test
    can tell the two apart by a bound far from both, whatever the machine's speed."""
    yield from _stack(tmp_root, request, infer2=True, access_log=True,
                      overrides=("gateway.drain_timeout_s=120",))


def _stack(tmp_root: Path, request: pytest.FixtureRequest, infer2: bool = False,
           access_log: bool = False, overrides: tuple[str, ...] = ()) -> Iterator[Cluster]:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"the multi-host tests are skipped (${SKIP_ENV}=1)")
    why = missing_capability()
    if why:
        pytest.skip(f"the multi-host harness cannot run here, so the multi-host tests did not "
                    f"run: {why}")
    cluster = Cluster(run_dir=tmp_root / f"multihost-{request.module.__name__.rsplit('.', 1)[-1]}",
                      prefix=PREFIX, infer2=infer2, access_log=access_log,
                      overrides=overrides)
    for prefix in stack_prefixes():
        stale = STALE.match(prefix)
        if stale and not Path(f"/proc/{stale.group(1)}").exists():
            Cluster(run_dir=tmp_root / "multihost-stale", prefix=prefix).down()
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()
        left = namespaces(PREFIX)
        assert not left, f"namespaces left behind: {left}"


def train(cluster: Cluster, *overrides: str, timeout: float = RUN_TIMEOUT_S
          ) -> subprocess.CompletedProcess:
    """``carryover train`` on the trainer host, to its end."""
    out = cluster.run("trainer", ["carryover", "train", *overrides], timeout=timeout)
    assert out.returncode == 0, (f"carryover train exited {out.returncode}:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n"
                                 + cluster.tails(["infer", "roll1", "roll2", "trainer"]))
    return out


def run_id_of(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("run ") and " finished: " in line:
            return line.split()[1]
    raise AssertionError(f"no run id in:\n{output[-2000:]}")


def node_stats(ask: Callable[[], dict | None], want: Iterable[str], bound_s: float,
               pause_s: float = 2.0) -> dict:
    """Celery's ``inspect().stats()`` (``ask``) per node, asked again until every node of
    ``want`` has answered or ``bound_s`` has passed: a worker at nice 19 on a loaded machine
    can miss one inspect's reply window. A node's latest reply is kept."""
    want = set(want)
    deadline = time.monotonic() + bound_s
    out: dict = {}
    while True:
        out.update(ask() or {})
        if want <= set(out) or time.monotonic() >= deadline:
            return out
        time.sleep(pause_s)


# A run's record as the trainer host reads it from Redis and Celery: per step the groups it
# trained; per group the status and rollout id of each sibling result and what its trained
# guard holds; the run's counters; how many tasks of each name each Celery node ran (every
# node of the stack asked until it answered, within STATS_BOUND_S).
_RUN_STATE = """
import json, sys
from app.celery_app import celery_app
from app.config import service_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
from app.state.records import SiblingResult
from tests.multihost import node_stats
run_id, steps = sys.argv[1], int(sys.argv[2])
want, bound_s = json.loads(sys.argv[3]), float(sys.argv[4])
c = connect(resolve_redis_url(service_config()))
text = lambda v: v.decode() if isinstance(v, bytes) else v
out = {"steps": {}, "groups": {}, "run": {text(k): text(v) for k, v in
                                          c.hgetall(keys.run(run_id)).items()}}
for step in range(steps):
    out["steps"][step] = [text(g) for g in c.lrange(keys.run_step_groups(run_id, step), 0, -1)]
    for gid in out["steps"][step]:
        results = [SiblingResult.from_json(v) for v in c.hgetall(keys.group_results(gid)).values()]
        out["groups"][gid] = {"results": [r.status for r in results],
                              "rollouts": [r.rollout_id for r in results],
                              "trained": text(c.get(keys.group_trained(gid)))}
stats = node_stats(lambda: celery_app.control.inspect(timeout=5).stats(), want, bound_s)
out["tasks"] = {node: s.get("total", {}) for node, s in stats.items()}
print(json.dumps(out))
"""


def run_state(cluster: Cluster, run_id: str, steps: int, gone: Iterable[str] = ()) -> dict:
    """What the trainer host reads of run ``run_id``'s first ``steps`` steps; fails naming
    the stack's Celery nodes that never answered, but those in ``gone`` (on a host cut for
    good: they cannot)."""
    want = cluster.expected_nodes() - set(gone)
    argv = [str(BIN / "python"), "-c", _RUN_STATE, run_id, str(steps), json.dumps(sorted(want)),
            str(STATS_BOUND_S)]
    try:
        out = cluster.run("trainer", argv, timeout=STATS_BOUND_S + 300)
    except HarnessError as exc:
        raise AssertionError(str(exc)) from None
    assert out.returncode == 0, f"the look at run {run_id} exited {out.returncode}:\n" \
        + out.stderr[-3000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    missing = want - set(state["tasks"])
    assert not missing, (f"Celery nodes that never answered inspect().stats() in "
                         f"{STATS_BOUND_S:.0f} s: {sorted(missing)}; answered: "
                         f"{sorted(state['tasks'])}")
    return state


def assert_trained_once_and_whole(state: dict, steps: int, per_step: int, n: int) -> None:
    """Every step trained ``per_step`` groups of ``n`` ok siblings, no group twice."""
    trained = [g for s in range(steps) for g in state["steps"][str(s)]]
    assert [len(state["steps"][str(s)]) for s in range(steps)] == [per_step] * steps, state
    assert len(set(trained)) == len(trained), f"trained twice: {trained}"
    for step in range(steps):
        for gid in state["steps"][str(step)]:
            group = state["groups"][gid]
            assert group["trained"] == str(step), (gid, step, group)
            assert len(group["results"]) == n and set(group["results"]) == {"ok"}, (gid, group)


def metrics_rows(cluster: Cluster, run_id: str) -> list[dict]:
    path = cluster.host_dir("trainer") / "runs" / run_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# The driver, as `carryover train` runs it, with a stop of the test's: it ends the run (as
# finished) after the step during which the file argv[1] appeared.
DRIVER = """
import json, logging, os, sys
from pathlib import Path
from app.config import load_config
from app.config.loader import env_overrides
stop, run_id = Path(sys.argv[1]), sys.argv[2]
overrides = [*env_overrides(), *sys.argv[3:]]
os.environ["CARRYOVER_OVERRIDES"] = json.dumps(overrides)
os.environ["CARRYOVER_ROLE"] = "driver"
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from app.driver.loop import train
cfg = load_config(os.environ["CARRYOVER_CONFIG"], overrides)
result = train(cfg, run_id=run_id, should_stop=lambda step, metrics: stop.exists())
print(f"run {result['run_id']} finished: {result['steps']} steps", flush=True)
"""
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)")


class Lines:
    """The lines a process writes, read in a thread: (time.monotonic(), line)."""

    def __init__(self, stream: IO[str]):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))[-4000:]

    def steps(self) -> list[tuple[float, int]]:
        """(when, step) of each step line the driver printed."""
        return [(t, int(m.group(1))) for t, line in list(self.lines)
                if (m := STEP_LINE.match(line))]


class Driver(Lines):
    """DRIVER run on the trainer host by ``start_driver``: the lines it prints (as ``Lines``),
    its process (a session of its own), its run id and the file that stops it."""

    def __init__(self, proc: subprocess.Popen, run_id: str, stop_file: Path):
        assert proc.stdout is not None
        super().__init__(proc.stdout)
        self.proc, self.run_id, self.stop_file = proc, run_id, stop_file

    def stop(self, deadline: float, output: Callable[[], str],
             within_s: float | None = None) -> None:
        """Ends the run after its current step and waits for the driver to exit, until
        ``deadline`` (``time.monotonic()``; 1 s at the least); else fails with ``output()``,
        naming the bound ``within_s`` from the run's start where given."""
        self.stop_file.touch()
        try:
            self.proc.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            bound = "" if within_s is None else f" in {within_s:.0f} s of the run's start"
            raise AssertionError(f"the driver did not stop{bound}:\n{output()}") from None

    def kill(self) -> None:
        """SIGKILL the driver's session, if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)


def start_driver(cluster: Cluster, *overrides: str) -> Driver:
    """DRIVER on the trainer host with ``overrides``, under a new run id; the file that will
    stop it (under the host's directory) removed first."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    stop = cluster.host_dir("trainer") / "stop-run"
    stop.unlink(missing_ok=True)
    proc = cluster.popen("trainer", [str(BIN / "python"), "-c", DRIVER, str(stop), run_id,
                                     *overrides],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Driver(proc, run_id, stop)


def stop_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (a program run on a host), if it still runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()


def stall(done: list[tuple[float, int]], cut_at: float, healed_at: float
          ) -> tuple[float, float, float]:
    """From the driver's step lines (``Lines.steps``): the median wait between two steps
    before the cut, the longest wait from the cut to the first step after the heal, and the
    longest after that."""
    import statistics

    gaps = [(a, b) for (a, _), (b, _) in zip(done, done[1:], strict=False)]
    ordinary = statistics.median(b - a for a, b in gaps if b <= cut_at)
    across = max(b - max(a, cut_at) for a, b in gaps if b > cut_at and a <= healed_at)
    after = max((b - a for a, b in gaps if a > healed_at), default=0.0)
    return ordinary, across, after


# On the trainer host: one completion with prompt log-probs, as the trainer's probe asks for,
# waited for as long as it takes. The first such call of a new server is its slowest (a loaded
# machine has taken minutes), and the trainer's own probe gives up after 60 s.
_WARM = """
import json
import httpx
from app.config import service_config
from app.config.secrets import inference_api_key
cfg = service_config()
r = httpx.post(cfg.inference.urls[0].rstrip("/") + "/v1/completions",
               json={"model": cfg.inference.served_model_name, "prompt": "warm up",
                     "max_tokens": 2, "prompt_logprobs": 0},
               headers={"Authorization": f"Bearer {inference_api_key(cfg)}"}, timeout=600)
print(json.dumps(r.status_code))
"""


def warm_inference(cluster: Cluster) -> None:
    """Have the inference server answer a probe-like call before a run starts."""
    status = cluster.python("trainer", _WARM, timeout=660)
    assert status == 200, f"the inference server answered {status} to a warm-up call"


# On the trainer host, driven by lines on stdin. "wait": answers "busy N" once the rollout
# worker of host argv[1] reports N tasks it runs (or "idle" after argv[2] seconds). "held":
# answers "held [[task, [group, index]], ...]", the messages that host's rollout worker received
# and Redis still holds unacknowledged (what the reaper will requeue): asked once the host
# is cut, when it can no longer acknowledge any.
CUT_PROBE = """
import ast, json, sys, time
from app.celery_app import celery_app
from app.config import service_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
host, wait_s = sys.argv[1], float(sys.argv[2])
node = "rollout@" + host
text = lambda v: v.decode() if isinstance(v, bytes) else v
c = connect(resolve_redis_url(service_config()))
with celery_app.connection_for_write() as conn:
    unacked = conn.default_channel.unacked_key
print("ready", flush=True)
for command in sys.stdin:
    if command.strip() == "wait":
        deadline, active = time.monotonic() + wait_s, {}
        while time.monotonic() < deadline:
            active = celery_app.control.inspect(destination=[node], timeout=1.0,
                                                limit=1).active() or {}
            if active.get(node):
                break
        print(f"busy {len(active[node])}" if active.get(node) else "idle", flush=True)
    elif command.strip() == "held":
        held = []
        for worker in map(text, c.smembers(keys.rollout_workers())):
            if worker.startswith(host + ":"):
                for tag in c.hkeys(keys.worker_deliveries(worker)):
                    body = c.hget(unacked, tag)
                    if body is not None:
                        headers = json.loads(body)[0]["headers"]
                        held.append([headers["task"], ast.literal_eval(headers["argsrepr"])])
        print("held " + json.dumps(held), flush=True)
"""


def probe_answer(proc: subprocess.Popen, command: str | None, prefix: tuple[str, ...]) -> str:
    """Writes ``command`` to the cut probe and returns its next line starting with one of
    ``prefix`` (the probe bounds its own waits)."""
    assert proc.stdin is not None and proc.stdout is not None
    if command is not None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the cut probe on the trainer host exited {proc.wait()}")

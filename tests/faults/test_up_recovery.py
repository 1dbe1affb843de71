"""``carryover up`` keeps the stack running when a part of it dies, on one shared stack.

- Redis SIGKILLed in the middle of ``carryover train``: the supervisor starts it again from
  its AOF, every role rides the gap, and the run finishes every step with full groups, none
  trained twice and no step lost. Killed at three points of a step (while groups are
  collected, during the update, and between the weight save/load and the version bump), and
  once more under the demo's load (``appendfsync everysec``, its concurrency).
- The rollout worker SIGKILLed in the middle of a run: it is started again, the groups
  worker's reaper requeues what it held, the run finishes every step with full groups, and
  ``carryover status`` counts the restart.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.services.health import role_restarts
from app.state import keys
from app.state.connection import connect, resolve_redis_url
from app.state.records import OutageRecord, SiblingResult
from bench.stack import UpStack, carryover_up, is_redis, is_rollout_worker, stack_overrides
from tests.conftest import REPO

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[UpStack]:
    """One ``carryover up`` on config/demo.yaml for the module's tests (a start and a stop
    cost ~25 s): each test trains a run of its own, and reads only what the stack logged and
    recorded since it began. With the demo's 256 rollout slots, which the demo-load test
    needs."""
    tmp = tmp_path_factory.mktemp("up-recovery")
    overrides = stack_overrides(
        tmp, "services.worker_heartbeat_s=3", f"logging.dir={tmp / 'runs'}",
        "logging.wandb_mode=disabled", f"trainer.weights_dir={tmp / 'w'}",
        f"trainer.checkpoint_dir={tmp / 'c'}")
    with carryover_up(overrides, tmp / "up.log") as up:
        yield up


def start_run(stack: UpStack, tmp_path: Path, *overrides: str
              ) -> tuple[subprocess.Popen, Callable[[], str | None]]:
    """``carryover train`` with the run's own ``overrides`` against the shared stack;
    returns it and a function giving its run id once the driver has made it."""
    assert stack.up.poll() is None, "carryover up exited during an earlier test"
    client = connect(resolve_redis_url(stack.cfg))
    before = set(client.scan_iter(keys.run("*") + ":metrics"))
    env = {**stack.env, "CARRYOVER_OVERRIDES": json.dumps([
        *json.loads(stack.env["CARRYOVER_OVERRIDES"]), f"logging.dir={tmp_path / 'runs'}",
        f"trainer.weights_dir={tmp_path / 'w'}", f"trainer.checkpoint_dir={tmp_path / 'c'}",
        *overrides])}
    train = subprocess.Popen([str(BIN / "carryover"), "train"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    found: list[str] = []

    def run_id() -> str | None:
        if not found:
            new = [k for k in client.scan_iter(keys.run("*") + ":metrics") if k not in before]
            found.extend(k.split(":")[-2] for k in new[:1])
        return found[0] if found else None

    return train, run_id


def kill_redis(stack: UpStack) -> None:
    stack.kill_role(is_redis)


def wait_for(what: str, cond: Callable[[], bool], train: subprocess.Popen, timeout: float,
             every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if train.poll() is not None:
            raise AssertionError(f"the run ended while waiting for {what}:\n"
                                 + train.communicate()[0][-4000:])
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def check_run(client, run_id: str, steps: int, batch: int, n: int) -> None:
    """Every step trained a full batch of full groups, no group twice, no step lost."""
    metrics = [json.loads(m) for m in client.lrange(keys.run_metrics(run_id), 0, -1)]
    assert sorted(m["step"] for m in metrics) == list(range(steps)), "a step lost or repeated"
    trained: collections.Counter[str] = collections.Counter()
    for step in range(steps):
        groups = client.lrange(keys.run_step_groups(run_id, step), 0, -1)
        assert len(groups) == batch, (step, groups)
        trained.update(groups)
        for gid in groups:
            assert client.get(keys.group_trained(gid)) == str(step), (gid, step)
            results = [SiblingResult.from_json(v)
                       for v in client.hgetall(keys.group_results(gid)).values()]
            assert len(results) == n and all(r.status == "ok" for r in results), gid
    twice = [g for g, c in trained.items() if c > 1]
    assert not twice, f"trained twice: {twice}"


@contextmanager
def stopped_on_exit(train: subprocess.Popen) -> Iterator[None]:
    """``carryover train`` is killed if the test leaves before it ended."""
    try:
        yield
    finally:
        if train.poll() is None:
            train.kill()


def succeeded(train: subprocess.Popen, timeout: float) -> None:
    out, _ = train.communicate(timeout=timeout)
    assert train.returncode == 0, out[-4000:]


def small_runs(steps: int, batch: int, n: int) -> list[str]:
    """A run smaller than the demo's, with 8 groups active."""
    return [f"data.train_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}",
            "agentlightning.async_rollout.async_train_batch_size=8",
            f"trainer.total_steps={steps}"]


def steps_done(client, run_id: Callable[[], str | None]) -> int:
    rid = run_id()
    return client.llen(keys.run_metrics(rid)) if rid else 0


def test_redis_killed_at_three_points_of_a_step(stack, tmp_path):
    # the third kill needs a look in a window of tens of milliseconds: a step for each try
    # (a loaded machine may miss a few)
    steps, batch, n = 11, 4, 2
    client = connect(resolve_redis_url(stack.cfg))
    log_from = len(stack.log.read_text())
    began = time.time()
    train, run_id = start_run(stack, tmp_path, *small_runs(steps, batch, n))
    with stopped_on_exit(train):
        # 1. while groups are collected: step 1 is waiting for completions
        wait_for("step 0", lambda: steps_done(client, run_id) >= 1, train, 240)
        wait_for("collection", lambda: not client.exists(keys.paused()), train, 60, 0.01)
        kill_redis(stack)
        # 2. during the update: the trainer holds the gateway paused
        wait_for("step 2", lambda: steps_done(client, run_id) >= 3, train, 240)
        wait_for("an update", lambda: client.exists(keys.paused()), train, 120, 0.005)
        kill_redis(stack)
        # 3. between the weight save/load and the version bump: the new version's
        # weights are on disk, the version not bumped yet. The window is tens of
        # milliseconds; a look that comes after the bump tries the next step.
        wait_for("step 4", lambda: steps_done(client, run_id) >= 5, train, 240)
        # where the trainer exports (weights_dir, or shared memory: weights_in_memory)
        weights_dir = Path(client.hget(keys.policy_published(), "path")).parent
        for _ in range(steps - 5):
            version = int(client.get(keys.policy_version()) or 0)
            new = weights_dir / f"v{version + 1:06d}"
            wait_for("the next weights", new.exists, train, 120, 0.002)
            if int(client.get(keys.policy_version()) or 0) == version:
                kill_redis(stack)
                break
        else:
            pytest.fail("no look at the weights came before the version bump")
        succeeded(train, 300)
    assert stack.up.poll() is None  # the stack is still up
    check_run(client, run_id(), steps, batch, n)
    # the version went up once per step and the gateway never went back
    assert int(client.get(keys.policy_version())) >= steps
    up_log = stack.log_since(log_from)
    # each exit is logged with what ended it: "redis exited (SIGKILL (signal 9), pid ..."
    assert up_log.count("redis exited (SIGKILL (signal 9)") == 3, up_log[-3000:]
    assert up_log.count(" exited (") == 3, up_log[-3000:]  # no other role died
    outages = [o for o in map(OutageRecord.from_json, client.lrange(keys.redis_outages(), 0, -1))
               if o.down_at >= began]  # this test's (the newest first, a capped list)
    assert {"driver", "gateway", "rollout", "groups", "trainer"} <= {o.role for o in outages}
    # every part up, Flower too. A worker answers the status's broadcast once Celery has
    # re-joined its control mailbox after the broker's restart, which can take a few
    # seconds more than its consumer (seen on a busy 2-core machine): asked until then.
    deadline = time.monotonic() + 30
    while True:
        status = subprocess.run([str(BIN / "carryover"), "status"], cwd=REPO, env=stack.env,
                                capture_output=True, text=True, timeout=60)
        if status.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "redis outage" in status.stdout, status.stdout
    assert status.returncode == 0, status.stdout + status.stderr


def test_redis_killed_under_the_demo_load(stack, tmp_path):
    """The demo's shape and concurrency (16 groups of 8, 32 active, 256 rollout slots)."""
    steps = 4
    client = connect(resolve_redis_url(stack.cfg))
    log_from = len(stack.log.read_text())
    train, run_id = start_run(stack, tmp_path, f"trainer.total_steps={steps}")
    with stopped_on_exit(train):
        wait_for("step 0", lambda: steps_done(client, run_id) >= 1, train, 300)
        # with calls in flight: the gateway holds leases
        wait_for("calls in flight", lambda: client.zcard(keys.leases()) >= 8, train, 60, 0.01)
        kill_redis(stack)
        succeeded(train, 400)
    check_run(client, run_id(), steps, int(stack.cfg.data.train_batch_size),
              int(stack.cfg.actor_rollout_ref.rollout.n))
    up_log = stack.log_since(log_from)
    assert up_log.count(" exited (") == 1, up_log[-3000:]  # only Redis died


def test_messages_delivered_before_the_crash_are_redelivered(stack, tmp_path):
    """Redis and the rollout worker SIGKILLed together while its rollouts run: the messages
    it held, unacknowledged (acks_late), are still in Redis after the restart, and the
    restarted worker's reaper puts them back, so every group completes."""
    steps, batch, n = 4, 4, 2
    client = connect(resolve_redis_url(stack.cfg))
    log_from = len(stack.log.read_text())
    train, run_id = start_run(stack, tmp_path, *small_runs(steps, batch, n))
    with stopped_on_exit(train):
        wait_for("step 0", lambda: steps_done(client, run_id) >= 1, train, 240)
        wait_for("rollouts running", lambda: client.zcard(keys.leases()) >= 2, train, 60,
                 0.005)
        stack.kill_role(is_rollout_worker)
        kill_redis(stack)
        succeeded(train, 400)
    check_run(client, run_id(), steps, batch, n)
    up_log = stack.log_since(log_from)
    assert "redis exited (SIGKILL (signal 9)" in up_log and "rollout exited (" in up_log


def restarts(stack: UpStack, role: str) -> int:
    """How many times the supervisor started ``role`` again, as ``carryover status`` reads
    it (an earlier test on the shared stack may have restarted it)."""
    counts = role_restarts(stack.cfg, timeout=10)  # {} only when Redis did not answer
    assert counts or not connect(resolve_redis_url(stack.cfg)).exists(keys.role_restarts())
    return counts.get(role, 0)


def test_rollout_worker_killed_under_carryover_up(stack, tmp_path):
    steps, batch, n = 6, 4, 2
    client = connect(resolve_redis_url(stack.cfg))
    log_from = len(stack.log.read_text())
    before = restarts(stack, "rollout")
    train, run_id = start_run(stack, tmp_path, *small_runs(steps, batch, n))
    with stopped_on_exit(train):
        wait_for("step 1", lambda: steps_done(client, run_id) >= 2, train, 240)
        stack.kill_role(is_rollout_worker)
        succeeded(train, 400)
    assert stack.up.poll() is None  # the stack is still up
    check_run(client, run_id(), steps, batch, n)
    after = restarts(stack, "rollout")
    assert after == before + 1
    assert "starting it again" in stack.log_since(log_from)
    status = subprocess.run([str(BIN / "carryover"), "status"], cwd=REPO, env=stack.env,
                            capture_output=True, text=True, timeout=60)
    assert f"rollout x{after}" in status.stdout, status.stdout

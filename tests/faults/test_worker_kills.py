"""Processes SIGKILLed in the middle of their work, on the real stack.

- A rollout worker killed while every sibling runs: its peers (here: the worker that
  replaces it) requeue its unacknowledged messages; every group completes with all ``n``
  siblings, none is dropped, trained twice or trained partially.
- The trainer worker killed mid-update while the gateway is paused: the pause lease ends
  within ``trainer.heartbeat_s``, the driver re-sends the step, the new worker restores the
  last checkpoint and loads its weights into vLLM (verified by the probe) before training.
- The trainer worker killed inside the same step's update on every attempt (what the OOM
  killer does to an update too big for memory): the supervisor starts it again each time and
  records its exits, and after ``trainer.step_retries`` re-sends the run fails with one line
  naming the step, the signal and the settings that bound an update's memory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest

from app.state import keys
from app.state.pause import Admission
from app.state.records import SiblingResult
from tests.integration.test_collector import make_cfg, stack  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def sigkill(supervisor, role: str) -> None:
    proc = supervisor.procs.pop(role)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture(scope="module", autouse=True)
def fresh_trainer(celery_workers):  # noqa: F811
    """A new trainer worker process for these tests: whatever an earlier test's run left it
    doing (a step retried by a driver, a reload waiting for a server) must not hold the solo
    worker while these runs are timed."""
    if "trainer" in celery_workers.procs:
        sigkill(celery_workers, "trainer")
    celery_workers.start(["trainer"])
    return celery_workers


def wait_for(pred, timeout: float, what: str, poll: float = 0.01, detail=None) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start >= timeout:
            raise AssertionError(f"timed out waiting for {what}"
                                 + (f"\n{detail()}" if detail else ""))
        time.sleep(poll)
    return time.monotonic() - start


def train_in_thread(run_cfg, run_id: str, on_step=None) -> tuple[threading.Thread, dict]:
    from app.driver.loop import train

    out: dict = {}

    def target() -> None:
        try:
            out["result"] = train(run_cfg, run_id=run_id,
                                  on_step=on_step or (lambda s, m: None))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def _state(client, supervisor, run_id: str) -> str:
    """What a failure message needs to tell where a run stalled: the run's groups, the
    rollout workers' liveness and deliveries, and the end of each role's log."""
    parts = [f"run: {client.hgetall(keys.run(run_id))}",
             f"active: {client.smembers(keys.run_active(run_id))}",
             f"ready: {client.lrange(keys.run_ready(run_id), 0, -1)}"]
    for gid in client.smembers(keys.run_active(run_id)):
        parts.append(f"group {gid}: {client.hgetall(keys.group(gid))} results "
                     f"{sorted(client.hkeys(keys.group_results(gid)))}")
    for worker in client.smembers(keys.rollout_workers()):
        parts.append(f"rollout worker {worker}: alive={client.exists(keys.worker_alive(worker))}"
                     f" deliveries={client.hlen(keys.worker_deliveries(worker))}")
    parts.append(f"unacked: {client.hlen('unacked')}")
    for role in ("rollout", "groups", "trainer"):
        text = supervisor.log_path(role).read_text(errors="replace")
        parts.append(f"--- {role}.log (tail) ---\n" + text[-3000:])
    return "\n".join(parts)


def finished(thread: threading.Thread, out: dict, timeout: float, steps: int, what: str,
             client, supervisor, run_id: str) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), (f"training did not finish after {what}\n"
                                    + _state(client, supervisor, run_id))
    assert "error" not in out, out.get("error")
    assert out["result"]["steps"] == steps


def assert_trained_once_and_whole(client, run_id: str, steps: int, per_step: int,
                                  n: int) -> list[str]:
    trained = [g for s in range(steps) for g in client.lrange(keys.run_step_groups(run_id, s),
                                                              0, -1)]
    assert len(trained) == steps * per_step and len(set(trained)) == len(trained)
    for gid in trained:
        results = [SiblingResult.from_json(v)
                   for v in client.hgetall(keys.group_results(gid)).values()]
        assert len(results) == n and all(r.status == "ok" for r in results), gid
    return trained


def test_rollout_worker_sigkilled_mid_rollout(stack, tmp_path, celery_workers):  # noqa: F811
    samples = [{"gate": "after-kill"} for _ in range(4)]
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=2", "controller.max_attempts=1")
    run_id = "kill-rollout"
    thread, out = train_in_thread(run_cfg, run_id)
    # Every sibling has made its model call and waits at the gate, inside the worker.
    wait_for(lambda: sum(1 for _ in stack.scan_iter("co:rollout:*:calls")) >= 8, 90,
             "8 siblings running", detail=lambda: _state(stack, celery_workers, run_id))
    sigkill(celery_workers, "rollout")
    stack.set("test:gate:after-kill", 1)  # the re-run siblings pass straight through
    celery_workers.start(["rollout"])
    finished(thread, out, 180, 2, "the rollout worker died", stack, celery_workers, run_id)
    assert_trained_once_and_whole(stack, run_id, 2, 2, 2)
    run = stack.hgetall(keys.run(run_id))
    assert int(run.get("n_dropped", 0)) == 0  # requeued messages, not failed siblings
    # A peer (the groups worker or the new rollout worker) requeued all 8 messages.
    logs = "".join(celery_workers.log_path(r).read_text(errors="replace")
                   for r in ("rollout", "groups"))
    assert logs.count("died: requeued its task") >= 8
    assert "fired early" not in logs  # each sibling counted once by its chord


def kill_trainer_in_step_2(stack, tmp_path, celery_workers, run_id: str,  # noqa: F811
                           save_freq: int) -> list[dict]:
    """Train 4 steps of 2 groups, SIGKILL the trainer worker inside step 2's update (under
    the gateway's pause), start a new one; returns the steps' metrics."""
    samples = [{"sleep": 0.2} for _ in range(16)]
    heartbeat = 2.0
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=4", f"trainer.save_freq={save_freq}",
                       f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
                       f"trainer.heartbeat_s={heartbeat}",
                       "trainer.pause_during_update=true")  # the kill lands inside the pause
    thread, out = train_in_thread(run_cfg, run_id)
    # Tiny steps pause the gateway for a fraction of a second, too short to be sure of
    # catching. So once step 1 is done the test holds a model call "in flight" (a lease):
    # step 2's drain waits for it, and its pause lasts until the kill.
    wait_for(lambda: stack.llen(keys.run_metrics(run_id)) >= 2, 120, "step 1", poll=0.002,
             detail=lambda: _state(stack, celery_workers, run_id))
    adm = Admission(stack)
    status, lease, _ = adm.admit(f"{run_id}-inflight")
    wait_for(lambda: stack.exists(keys.trainer_heartbeat(run_id, "2"))
             and stack.exists(keys.paused()), 60, "step 2's update under the pause",
             poll=0.002)
    sigkill(celery_workers, "trainer")
    if status == 1:
        adm.release(lease)
    # Nobody resumes the gateway: its pause lease must simply run out.
    waited = wait_for(lambda: not stack.exists(keys.paused()), 2 * heartbeat + 5,
                      "the pause to expire")
    assert waited <= heartbeat + 3  # its lease (heartbeat_s) ran out: it is never resumed
    celery_workers.start(["trainer"])
    finished(thread, out, 240, 4, "the trainer worker died", stack, celery_workers, run_id)
    assert_trained_once_and_whole(stack, run_id, 4, 2, 2)
    rows = [json.loads(r) for r in stack.lrange(keys.run_metrics(run_id), 0, -1)]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    versions = [r["policy/version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 4
    return rows


def test_trainer_worker_killed_mid_update(stack, tmp_path, celery_workers):  # noqa: F811
    rows = kill_trainer_in_step_2(stack, tmp_path, celery_workers, "kill-trainer", 1)
    # Step 2 was retried by a new worker: it restored the checkpoint written after step 1
    # (``step_000002``, written in the background while step 2's groups were collected)
    # and published those weights (probe-verified) before training.
    assert rows[2]["trainer/restored_from_step"] == 2
    assert rows[2]["trainer/rolled_back_updates"] == 0  # save_freq 1: nothing lost
    # step 1 began by waiting for the checkpoint step 0 left writing
    assert rows[1]["timing/trainer_background_checkpoint_seconds"] > 0
    assert rows[1]["timing/trainer_wait_for_checkpoint_seconds"] >= 0


def test_a_step_that_kills_every_trainer_fails_the_run_saying_why(stack, tmp_path,  # noqa: F811
                                                                   celery_workers):
    from app.driver.step import TrainingFailed

    samples = [{"sleep": 0.2} for _ in range(8)]
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=2", "trainer.save_freq=1",
                       f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
                       "trainer.heartbeat_s=2", "trainer.step_retries=1",
                       "trainer.pause_during_update=true")
    run_id = "kill-trainer-every-time"
    # the supervisor watches its roles, as under `carryover up`: it starts the killed
    # trainer again and records how it ended
    stop = threading.Event()
    watcher = threading.Thread(target=celery_workers.watch_forever,
                               kwargs={"every_s": 0.2, "stop": stop.is_set}, daemon=True)
    watcher.start()
    adm = Admission(stack)
    held: list[tuple] = []

    def hold_a_call(step: int, metrics: dict) -> None:
        # a call held in flight: step 1's drain waits for it, under the pause. Taken here,
        # before the driver sends step 1 (its groups are often ready by then, and its
        # update on the tiny model lasts a few tens of ms: too short to catch by polling)
        if step == 0:
            held.append(adm.admit(f"{run_id}-inflight-0"))

    thread, out = train_in_thread(run_cfg, run_id, on_step=hold_a_call)
    step_1 = keys.trainer_heartbeat(run_id, "1")
    killed: list[int] = []
    try:
        wait_for(lambda: stack.llen(keys.run_metrics(run_id)) >= 1, 120, "step 0",
                 detail=lambda: _state(stack, celery_workers, run_id))
        for attempt in range(2):  # trainer.step_retries 1
            if attempt:
                wait_for(lambda: not stack.exists(step_1) and not stack.exists(keys.paused()),
                         30, "the dead worker's heartbeat and pause to expire")
                status, lease, _ = adm.admit(f"{run_id}-inflight-{attempt}")
            else:
                wait_for(lambda: bool(held), 30, "the call held before step 1")
                status, lease, _ = held[0]
            wait_for(lambda: stack.exists(step_1) and stack.exists(keys.paused()), 180,
                     f"attempt {attempt + 1} at step 1's update", poll=0.002,
                     detail=lambda: _state(stack, celery_workers, run_id))
            killed.append(celery_workers.procs["trainer"].pid)
            os.killpg(killed[-1], signal.SIGKILL)
            if status == 1:
                adm.release(lease)
        thread.join(60)
        assert not thread.is_alive(), "the run did not fail after the last attempt"
        # the supervisor has started the last one's successor (the next tests' trainer)
        wait_for(lambda: celery_workers.procs["trainer"].poll() is None
                 and "trainer" not in celery_workers.restart_due, 30, "the trainer's restart")
    finally:
        stop.set()
        watcher.join(10)
    error = out.get("error")
    assert isinstance(error, TrainingFailed), error
    said = str(error)
    assert "\n" not in said
    assert said.startswith("step 1: the trainer worker died in each of 2 attempts "
                           "(trainer.step_retries 1); 2 exits recorded (SIGKILL (signal 9) "
                           f"x2), the last: SIGKILL (signal 9), pid {killed[-1]} on "), said
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (" in said
    assert "actor_rollout_ref.actor.micro_batch_memory_gb (" in said
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (" in said
    assert stack.llen(keys.run_metrics(run_id)) == 1  # step 1 never recorded


def test_a_take_over_reports_the_updates_it_lost(stack, tmp_path,  # noqa: F811
                                                 celery_workers, caplog):
    """save_freq 3: the worker that dies in step 2 has written no checkpoint, so its
    successor starts from the initial weights and steps 0 and 1 are lost; the driver and
    the metrics say so."""
    caplog.set_level(logging.WARNING, logger="app.driver.step")
    rows = kill_trainer_in_step_2(stack, tmp_path, celery_workers, "kill-trainer-lost", 3)
    assert rows[2]["trainer/restored_from_step"] is None
    assert rows[2]["trainer/rolled_back_updates"] == 2
    assert "trainer/rolled_back_updates" not in rows[3]  # only the step that took it up
    warned = [r.getMessage() for r in caplog.records if "were lost" in r.getMessage()]
    assert len(warned) == 1 and "2 update(s)" in warned[0] and "save_freq 3" in warned[0]

"""A step whose trainer worker keeps dying fails the run with one line that says why: the
supervisor records each exit of the trainer (its signal or code, and the kernel's OOM kill
when the kernel's log or the memory cgroup shows one), and the driver's last give-up names
them with the knobs that bound an update's memory (``app.services.exits``,
``app.driver.trainer_call``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from app.driver import trainer_call
from app.driver.trainer_call import TrainerLost, call_trainer
from app.services import supervisor as sv
from app.services.commands import Command
from app.state import keys

OOM_LINE = ("Out of memory: Killed process {pid} (celery) total-vm:31235284kB, "
            "anon-rss:29876543kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:60000kB "
            "oom_score_adj:0")


class NeverAnswered:
    """A trainer task's result that never comes (its worker dies)."""

    id = "never-answered"

    def ready(self) -> bool:
        return False

    def get(self, timeout: float, **_: object) -> dict:
        time.sleep(timeout)
        raise CeleryTimeout()


@pytest.fixture
def dying_trainer(redis_client, monkeypatch):
    """``call_trainer``'s sends go to a stand-in trainer that takes each task (its heartbeat
    is seen) and is SIGKILLed in it, as the OOM killer ends an update too big for memory.
    ``hooks["kill"]`` kills it (set by a test that runs one under a supervisor)."""
    from app.celery_app import celery_app

    hooks: dict = {"sends": 0}

    def send_task(name: str, args: object = None, **_: object) -> NeverAnswered:
        hooks["sends"] += 1
        # seen by the driver's first polls, then expired: the worker died in the task
        redis_client.set(keys.trainer_heartbeat("dying", "3"), "w", px=1000)
        if "kill" in hooks:
            hooks["kill"]()
        return NeverAnswered()

    monkeypatch.setattr(celery_app, "send_task", send_task)
    monkeypatch.setattr(trainer_call, "RESULT_GRACE_S", 0.1)
    return hooks


def give_up(redis_client, cfg) -> str:
    with pytest.raises(TrainerLost) as lost:
        call_trainer(redis_client, cfg, "workers.trainer.tasks.train_step", "dying", "3",
                     ["dying", 3], poll_s=0.05,
                     if_lost=trainer_call.update_memory_knobs(cfg))
    return str(lost.value)


def test_a_trainer_sigkilled_in_every_attempt_is_named_when_the_driver_gives_up(
        dying_trainer, redis_client, cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    monkeypatch.setattr(sv, "BACKOFF_S", (0.05, 0.2))
    sup = sv.Supervisor(cfg, log_dir=tmp_path)
    sup._spawn(sv.command_for(cfg, "trainer"))
    stop = threading.Event()
    watcher = threading.Thread(target=sup.watch_forever, kwargs={"every_s": 0.05,
                                                                  "stop": stop.is_set})
    watcher.start()
    killed: list[int] = []

    def kill() -> None:
        deadline = time.monotonic() + 10
        # the supervisor started it again after the last kill
        while sup.procs["trainer"].poll() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        killed.append(sup.procs["trainer"].pid)
        os.killpg(sup.procs["trainer"].pid, signal.SIGKILL)

    dying_trainer["kill"] = kill
    try:
        message = give_up(redis_client, cfg)
    finally:
        stop.set()
        watcher.join()
        sup.stop(grace=2)
    assert dying_trainer["sends"] == 3 and len(killed) == 3  # step_retries 2
    assert "\n" not in message
    assert "died in each of 3 attempts (trainer.step_retries 2)" in message
    assert "3 exits recorded (SIGKILL (signal 9) x3)" in message
    assert f"the last: SIGKILL (signal 9), pid {killed[-1]} on {os.uname().nodename}" in message
    for knob in ("ppo_max_token_len_per_gpu", "micro_batch_memory_gb",
                 "ppo_micro_batch_size_per_gpu"):
        assert f"actor_rollout_ref.actor.{knob} (" in message
    assert message.endswith('see docs/gpu.md, "Micro-batch memory"')


def test_a_trainer_no_supervisor_watched_is_said_to_have_left_no_record(
        dying_trainer, redis_client, cfg):
    """A trainer worker started by hand: the driver knows only that its heartbeat
    expired, says so, and still names the knobs."""
    message = give_up(redis_client, cfg)
    assert "died in each of 3 attempts" in message
    assert "no exit of the trainer worker was recorded" in message
    assert "actor_rollout_ref.actor.micro_batch_memory_gb (" in message


def test_exits_recorded_before_the_task_was_sent_are_not_its(dying_trainer, redis_client,
                                                             cfg):
    from app.services.exits import write_exit
    from app.state.records import RoleExit

    write_exit(redis_client, RoleExit("trainer", "h", 1, -9, at=time.time()))
    time.sleep(0.01)  # the stream's ids are Redis's milliseconds
    assert "no exit of the trainer worker was recorded" in give_up(redis_client, cfg)


def test_an_exit_says_what_the_kernel_said(tmp_path):
    from app.state.records import RoleExit

    oom = RoleExit("trainer", "gpu1", 4242, -9, at=0.0, oom=OOM_LINE.format(pid=4242))
    assert oom.describe() == ("SIGKILL (signal 9), pid 4242 on gpu1 at 00:00:00 UTC, the "
                              f'kernel: "{OOM_LINE.format(pid=4242)}"')
    by_cgroup = RoleExit("trainer", "h", 7, -9, oom_kills=1)
    assert "the OOM killer ended 1 process(es) in its memory cgroup" in by_cgroup.describe()
    clean = RoleExit("trainer", "h", 7, -9)
    assert "no OOM kill of it in the kernel's log" in clean.describe()
    unread = RoleExit("trainer", "h", 7, -9, kernel_log="/dev/kmsg: Operation not permitted")
    assert ("the kernel's log could not be read (/dev/kmsg: Operation not permitted)"
            in unread.describe())
    assert RoleExit("trainer", "h", 7, 1).describe().startswith("exit code 1, pid 7 on h")
    assert RoleExit.from_hash(oom.to_hash()) == oom


def test_the_oom_kill_of_a_pid_is_found_in_the_kernel_log(tmp_path):
    from app.services.exits import oom_kill_line

    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,100,1000,-;eth0: link up\n"
        "3,101,2000,-;Out of memory: Killed process 777 (python) total-vm:1kB\n"
        "6,102,2100,-;oom-kill:constraint=CONSTRAINT_NONE,task=celery,pid=4242,uid=0\n"
        f"3,103,2200,-;{OOM_LINE.format(pid=4242)}\n"
        " SUBSYSTEM=memory\n")
    assert oom_kill_line(4242, kmsg) == (OOM_LINE.format(pid=4242), "")
    assert oom_kill_line(42, kmsg) == ("", "")  # readable: no OOM kill of that pid
    line, why = oom_kill_line(4242, tmp_path / "absent")
    assert line == "" and "absent" in why  # unreadable: said, never raised


def test_the_memory_cgroups_oom_kill_count_is_read_where_it_is(tmp_path):
    from app.services.exits import cgroup_oom_kills

    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    (tmp_path / "fs" / "a" / "b").mkdir(parents=True)
    (tmp_path / "fs" / "a" / "b" / "memory.events").write_text(
        "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert cgroup_oom_kills(tmp_path / "fs", proc) == 2
    proc.write_text("4:memory:/c\n0::/\n")  # v1
    (tmp_path / "fs" / "memory" / "c").mkdir(parents=True)
    (tmp_path / "fs" / "memory" / "c" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert cgroup_oom_kills(tmp_path / "fs", proc) == 5
    assert cgroup_oom_kills(tmp_path / "none", proc) is None


def test_the_demo_says_a_failed_run_in_one_line(monkeypatch, capsys):
    """``carryover demo`` ends a run that failed as ``carryover train`` does: one line, no
    traceback."""
    import argparse

    from app import demo
    from app.driver.step import TrainingFailed

    class Stack:
        def __init__(self, cfg: object) -> None:
            pass

        def start(self, progress: object = None) -> None:
            pass

        def watch_forever(self, stop: object = None, **_: object) -> None:
            pass

        def stop(self) -> None:
            pass

    def train_one(cfg: object, label: str) -> dict:
        raise TrainingFailed("step 1: the trainer worker died in each of 3 attempts")

    for name in ("CARRYOVER_CONFIG", "CARRYOVER_OVERRIDES"):  # run_demo sets them
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(sv, "Supervisor", Stack)
    monkeypatch.setattr(demo, "preflight", lambda cfg: [])
    monkeypatch.setattr(demo, "_train_one", train_one)
    args = argparse.Namespace(config=None, overrides=[], steps=None, sync=False,
                              compare=False)
    assert demo.run_demo(args) == 1
    assert capsys.readouterr().err == ("error: step 1: the trainer worker died in each of 3 "
                                       "attempts\n")

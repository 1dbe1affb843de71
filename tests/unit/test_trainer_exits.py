"""A step whose trainer worker keeps dying fails the run with one line that says why: the
supervisor records each exit of the trainer (its signal or code, and the kernel's OOM kill
when the kernel's log or the memory cgroup shows one), and the driver's last give-up names
them with the knobs that bound an update's memory (``app.services.exits``,
``app.driver.trainer_call``)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from app.driver import trainer_call
from app.driver.trainer_call import TrainerLost, call_trainer
from app.services import supervisor as sv
from app.services.commands import Command
from app.state import keys
from app.state.records import RoleExit

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
    """A trainer worker started outside the supervisor: the driver knows only that its
    heartbeat expired, says so, and still names the knobs."""
    message = give_up(redis_client, cfg)
    assert "died in each of 3 attempts" in message
    assert "no exit of the trainer worker was recorded" in message
    assert "actor_rollout_ref.actor.micro_batch_memory_gb (" in message


def test_no_exit_recorded_names_the_starts_that_record_none():
    said = trainer_call._exits_said([])
    assert said.startswith("no exit of the trainer worker was recorded")
    for start in ("by hand", "`make up`/`honcho start`", "by Kubernetes"):
        assert start in said


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
    from app.services.exits import kmsg_position, oom_kill_line

    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,100,1000,-;eth0: link up\n"
        "3,101,2000,-;Out of memory: Killed process 777 (python) total-vm:1kB\n"
        "6,102,2100,-;oom-kill:constraint=CONSTRAINT_NONE,task=celery,pid=4242,uid=0\n"
        f"3,103,2200,-;{OOM_LINE.format(pid=4242)}\n"
        " SUBSYSTEM=memory\n")
    assert kmsg_position(kmsg) == 103
    assert oom_kill_line(4242, 101, kmsg) == (OOM_LINE.format(pid=4242), "", "")
    assert oom_kill_line(42, 101, kmsg) == ("", "", "")  # readable: no OOM kill of that pid
    # written before the role started: another process that had the pid
    assert oom_kill_line(777, 101, kmsg) == ("", "", "")
    assert oom_kill_line(4242, 103, kmsg) == ("", "", "")
    # records after the start overwritten before the exit was read: not a "no"
    line, why, unmatched = oom_kill_line(42, 95, kmsg)
    assert line == why == "" and "overwritten" in unmatched
    line, why, _ = oom_kill_line(4242, 0, tmp_path / "absent")
    assert line == "" and "absent" in why  # unreadable: said, never raised
    assert kmsg_position(tmp_path / "absent") is None
    kmsg.write_text("")
    assert kmsg_position(kmsg) == -1  # readable, empty: every later record counts


def test_pids_are_the_kernels_only_in_the_initial_pid_namespace(tmp_path):
    from app.services.exits import pids_are_the_kernels

    status = tmp_path / "status"
    status.write_text("Name:\tcarryover\nNSpid:\t812\t7\n")
    assert not pids_are_the_kernels(Path("/proc/self/ns/pid"), status)  # nested
    status.write_text("Name:\tcarryover\nNSpid:\t7\n")
    ns = tmp_path / "ns"  # another namespace: one pid shown, not the kernel's
    ns.write_text("")
    assert not pids_are_the_kernels(ns, status)
    assert not pids_are_the_kernels(tmp_path / "absent", status)
    assert not pids_are_the_kernels(Path("/proc/self/ns/pid"), tmp_path / "absent")


class KernelLog:
    """``os`` as ``app.services.exits`` sees it, with ``/dev/kmsg`` read from ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def open(self, path: object, flags: int, *args: int) -> int:
        return os.open(self.path if str(path) == "/dev/kmsg" else path, flags, *args)


def _exit_under_supervisor(cfg, tmp_path, monkeypatch, kernel: Path,
                           logged: Callable[[int], str]):
    """The RoleExit a supervisor records for a trainer it started and that was SIGKILLed,
    the kernel's log (``kernel``) then holding ``logged(pid)``."""
    from app.services import exits

    monkeypatch.setattr(exits, "os", KernelLog(kernel))
    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    sup = sv.Supervisor(cfg, log_dir=tmp_path)
    try:
        sup._spawn(sv.command_for(cfg, "trainer"))
        proc = sup.procs["trainer"]
        kernel.write_text(logged(proc.pid))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        sup._look([])
        return sup.unwritten_exits[-1]
    finally:
        sup.stop(grace=2)


def test_an_old_oom_kill_of_a_reused_pid_is_not_this_exit_s(cfg, tmp_path, monkeypatch):
    """The kernel's log still holds the OOM kill of an earlier process that had the pid:
    this SIGKILL (not the OOM killer's) is not blamed on it; one logged after the start is."""
    from app.services import exits

    monkeypatch.setattr(exits, "pids_are_the_kernels", lambda *_: True, raising=False)
    kernel = tmp_path / "kmsg"
    kernel.write_text("6,0,1,-;Linux version\n6,1,2,-;eth0: link up\n")  # at the start
    record = _exit_under_supervisor(
        cfg, tmp_path, monkeypatch, kernel,
        lambda pid: f"6,0,1,-;Linux version\n3,1,2,-;{OOM_LINE.format(pid=pid)}\n"
                    "6,2,3,-;eth0: link down\n")
    assert record.oom == ""
    assert "no OOM kill of it in the kernel's log" in record.describe()
    kernel.write_text("6,0,1,-;Linux version\n6,1,2,-;eth0: link up\n")
    record = _exit_under_supervisor(
        cfg, tmp_path, monkeypatch, kernel,
        lambda pid: f"6,0,1,-;Linux version\n6,1,2,-;eth0: link up\n"
                    f"3,2,3,-;{OOM_LINE.format(pid=pid)}\n")
    assert record.oom == OOM_LINE.format(pid=record.pid)


def test_in_a_pid_namespace_of_its_own_the_log_is_said_not_to_match(cfg, tmp_path,
                                                                   monkeypatch):
    """In a container the kernel logs host pids: a log without the supervisor's pid for the
    trainer is no sign that no OOM kill ended it."""
    from app.services import exits

    monkeypatch.setattr(exits, "pids_are_the_kernels", lambda *_: False, raising=False)
    kernel = tmp_path / "kmsg"
    kernel.write_text("6,0,1,-;Linux version\n")
    record = _exit_under_supervisor(
        cfg, tmp_path, monkeypatch, kernel,
        lambda pid: "6,0,1,-;Linux version\n3,1,2,-;" + OOM_LINE.format(pid=pid + 90000)
        + "\n")
    said = record.describe()
    assert "no OOM kill" not in said
    assert "the kernel's log could not be matched to it (the supervisor runs in a pid " \
        "namespace of its own" in said
    assert RoleExit.from_hash(record.to_hash()) == record


def test_a_log_unreadable_at_the_start_is_not_read_at_the_exit(monkeypatch):
    from app.services import exits

    monkeypatch.setattr(exits, "pids_are_the_kernels", lambda *_: True)
    proc = subprocess.Popen(["true"])
    proc.wait()
    record = exits.role_exit("trainer", proc, None, None)
    assert record.oom == "" and "not readable when the role started" in record.kernel_log


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

"""The supervisor keeps a stack running: a role that exits is started again after a backoff
(its peers untouched), and only a role that keeps failing right after its start stops it."""

from __future__ import annotations

import signal
import time

import pytest

from app.config import load_config
from app.config.loader import env_overrides
from app.services import supervisor as sv
from app.services.commands import Command
from app.state import keys


@pytest.fixture
def sup(tmp_path, monkeypatch):
    programs = {"rollout": ["sleep", "60"], "gateway": ["sleep", "60"]}
    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, programs[role]))
    monkeypatch.setattr(sv, "BACKOFF_S", (0.2, 1.0))
    monkeypatch.setattr(sv.Supervisor, "_count_restarts", lambda self: None)
    # the stand-ins listen on nothing: no port is checked, so neither a user's stack on the
    # default ports nor the session's own gateway on its ports is in their way
    monkeypatch.setattr(sv, "_listen_address", lambda cfg, role: None)
    s = sv.Supervisor(load_config(None, env_overrides()), log_dir=tmp_path)
    for role in programs:
        s._spawn(sv.command_for(s.cfg, role))
    s.programs = programs
    yield s
    s.stop(grace=2)


def test_a_killed_role_is_started_again_and_its_peers_go_on(sup):
    gateway = sup.procs["gateway"]
    old = sup.procs["rollout"]
    old.send_signal(signal.SIGKILL)
    old.wait()
    deadline = time.monotonic() + 5
    while sup.procs["rollout"] is old and time.monotonic() < deadline:
        sup.watch()
        time.sleep(0.05)
    assert sup.procs["rollout"] is not old and sup.procs["rollout"].poll() is None
    assert sup.restarts == {"rollout": 1}
    assert sup.procs["gateway"] is gateway and gateway.poll() is None  # untouched


def test_a_role_that_keeps_failing_at_start_stops_the_stack(sup):
    sup.programs["rollout"] = ["false"]  # every start exits at once
    sup.procs["rollout"].send_signal(signal.SIGKILL)
    with pytest.raises(sv.RoleFailing, match="rollout exited 6 times in a row"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sup.watch()
            time.sleep(0.05)
    assert sup.restarts["rollout"] == sv.MAX_QUICK_FAILURES
    assert sup.procs["gateway"].poll() is None


def test_counting_a_restart_never_waits_for_redis(tmp_path, monkeypatch, cfg, redis_client):
    """The restart count goes to Redis, which may be the role that is down and waiting for
    this very loop to start it again: a count that rode out the outage (as every other
    client does) held the loop, and Redis with it, for the whole reconnect window. The
    count is made at a later look, once Redis answers."""
    from bench.stack import free_port

    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    monkeypatch.setattr(sv, "BACKOFF_S", (0.2, 1.0))
    s = sv.Supervisor(load_config(None, [*env_overrides(), f"redis.port={free_port()}",
                                        "redis.reconnect_s=30"]),
                      log_dir=tmp_path)
    try:
        s._spawn(sv.command_for(s.cfg, "rollout"))
        s.procs["rollout"].send_signal(signal.SIGKILL)
        s.procs["rollout"].wait()
        began = time.monotonic()
        deadline = began + 20
        while not s.restarts and time.monotonic() < deadline:
            s.watch()
            time.sleep(0.05)
        assert s.restarts == {"rollout": 1}
        assert time.monotonic() - began < 15  # not the 30 s reconnect window
        assert s.uncounted == {"rollout": 1}
        s.cfg = cfg  # Redis answers again (the session's)
        s.watch()
        assert not s.uncounted
        assert sv.health.role_restarts(cfg) == {"rollout": 1}
    finally:
        s.stop(grace=2)


def test_a_count_whose_reply_was_lost_is_not_counted_twice(tmp_path, monkeypatch, cfg,
                                                           redis_client):
    """Redis applied the count, but its reply came after the 1 s the supervisor waits: the
    count is made again at a later look, and must not add a second restart."""
    import redis

    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    monkeypatch.setattr(sv, "BACKOFF_S", (0.2, 1.0))
    conn = redis.connection.AbstractConnection  # TCP or a unix socket
    real_send, real_read = conn.send_packed_command, conn.read_response
    lost: list[bytes] = []

    def send(self, command, *a, **kw):
        # the count is sent (and applied); its reply will not arrive in time
        packed = b"".join(command) if isinstance(command, list) else command
        real_send(self, command, *a, **kw)  # (a first send connects: the handshake's own)
        self._count_in_flight = keys.role_restarts().encode() in packed and not lost

    def read(self, *a, **kw):
        out = real_read(self, *a, **kw)
        if getattr(self, "_count_in_flight", False):
            self._count_in_flight = False
            lost.append(b"reply")
            raise redis.TimeoutError("Timeout reading from socket")
        return out

    monkeypatch.setattr(conn, "send_packed_command", send)
    monkeypatch.setattr(conn, "read_response", read)
    s = sv.Supervisor(cfg, log_dir=tmp_path)
    try:
        s._spawn(sv.command_for(s.cfg, "rollout"))
        s.procs["rollout"].send_signal(signal.SIGKILL)
        s.procs["rollout"].wait()
        deadline = time.monotonic() + 10
        while not s.restarts and time.monotonic() < deadline:
            s.watch()
            time.sleep(0.05)
        assert s.restarts == {"rollout": 1} and lost
        assert s.uncounted == {"rollout": 1}  # as far as the supervisor knows
        s.watch()  # the later look makes the count again
        assert not s.uncounted and len(lost) == 1
        assert sv.health.role_restarts(cfg) == {"rollout": 1}
    finally:
        s.stop(grace=2)


def _restart(s: sv.Supervisor, role: str) -> None:
    old = s.procs[role]
    old.send_signal(signal.SIGKILL)
    old.wait()
    deadline = time.monotonic() + 10
    while s.procs[role] is old and time.monotonic() < deadline:
        s.watch()
        time.sleep(0.05)
    assert s.procs[role] is not old


def test_counts_a_redis_crash_lost_are_written_again_after_its_restart(
        tmp_path, monkeypatch, cfg, redis_client):
    """Redis's AOF (fsync every second) may lose the last counts with a crash: once the
    supervisor has started Redis again, it writes every role's total, not only Redis's."""
    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    monkeypatch.setattr(sv, "BACKOFF_S", (0.2, 1.0))
    # a stand-in named redis (the session's Redis answers): its port is not its own to take
    monkeypatch.setattr(sv, "_listen_address", lambda cfg, role: None)
    s = sv.Supervisor(cfg, log_dir=tmp_path)
    try:
        for role in ("redis", "rollout"):
            s._spawn(sv.command_for(s.cfg, role))
        _restart(s, "rollout")
        assert sv.health.role_restarts(cfg) == {"rollout": 1}
        redis_client.delete(keys.role_restarts())  # lost with the crash
        _restart(s, "redis")
        assert sv.health.role_restarts(cfg) == {"rollout": 1, "redis": 1}
    finally:
        s.stop(grace=2)


def test_a_role_whose_program_is_gone_is_a_startup_error_naming_it(sup):
    sup.programs["rollout"] = ["/nonexistent/celery"]
    with pytest.raises(sv.StartupError, match="rollout: cannot run /nonexistent/celery"):
        sup._spawn(sv.command_for(sup.cfg, "rollout"))


def test_a_restart_that_cannot_start_is_tried_again_then_stops_the_stack(sup):
    """A restart whose start fails (its program gone, its port taken) is a failure at once:
    the same backoff, and the stack stops after as many as an exit right after start."""
    sup.programs["rollout"] = ["/nonexistent/celery"]
    sup.procs["rollout"].send_signal(signal.SIGKILL)
    with pytest.raises(sv.RoleFailing, match="rollout could not be started again "
                                             r"\(rollout: cannot run /nonexistent/celery"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sup.watch()
            time.sleep(0.05)
    assert sup.procs["gateway"].poll() is None  # the peers carried on until then


def test_ctrl_c_during_start_says_so_and_stops_what_was_started(tmp_path, monkeypatch,
                                                                caplog):
    """A start interrupted while the roles come up (vLLM may take its 20 s of grace to
    stop) says at once that it is stopping them, and leaves none running."""
    monkeypatch.setattr(sv, "command_for", lambda cfg, role: Command(role, ["sleep", "60"]))
    monkeypatch.setattr(sv, "_listen_address", lambda cfg, role: None)

    def interrupted(cfg, roles, *a, **kw):
        if roles != ["redis"]:
            raise KeyboardInterrupt
        return []

    monkeypatch.setattr(sv, "wait_ready", interrupted)
    # the session's own ports: a user's stack may be running on the defaults
    s = sv.Supervisor(load_config(None, env_overrides()), log_dir=tmp_path)
    started: list = []
    real_spawn = s._spawn

    def spawn(cmd):
        real_spawn(cmd)
        started.append(s.procs[cmd.role])

    s._spawn = spawn
    with caplog.at_level("WARNING"), pytest.raises(KeyboardInterrupt):
        s.start(["redis", "gateway", "rollout"])
    assert "start interrupted: stopping the roles started so far (redis, gateway, " \
           "rollout)" in caplog.text
    assert len(started) == 3 and all(p.poll() is not None for p in started)


def test_a_restart_that_failed_once_succeeds_at_the_next_try(sup, monkeypatch):
    real_signal = sv._signal_group
    signalled: list[tuple[int, int]] = []

    def recorded(proc, sig):
        signalled.append((proc.pid, sig))
        real_signal(proc, sig)

    monkeypatch.setattr(sv, "_signal_group", recorded)
    sup.programs["rollout"] = ["/nonexistent/celery"]
    old = sup.procs["rollout"]
    old.send_signal(signal.SIGKILL)
    old.wait()
    deadline = time.monotonic() + 10
    while "rollout" not in sup.start_errors and time.monotonic() < deadline:
        sup.watch()
        time.sleep(0.05)
    assert "rollout" in sup.start_errors and sup.restarts == {}  # a try is not a restart
    sup.programs["rollout"] = ["sleep", "60"]  # the program is back
    while sup.procs["rollout"] is old and time.monotonic() < deadline + 10:
        sup.watch()
        time.sleep(0.05)
    assert sup.procs["rollout"] is not old and sup.procs["rollout"].poll() is None
    assert sup.restarts == {"rollout": 1} and not sup.start_errors
    # the dead role's group was killed once, not again at the second try
    assert signalled.count((old.pid, signal.SIGKILL)) == 1


def test_a_restart_whose_command_cannot_be_built_is_retried_not_fatal(sup, monkeypatch):
    """vLLM died while its model directory was briefly unreadable (a network file system's
    blip): building its command raises a config error. That is one failed start, with the
    backoff, not the end of every role (it stopped the stack with exit code 2)."""
    from app.config import ConfigError

    built = []

    def command_for(cfg, role):
        built.append(role)
        if len(built) == 1:
            raise ConfigError(["actor_rollout_ref.model.path: no model (config.json) in /nfs"])
        return Command(role, sup.programs[role])

    monkeypatch.setattr(sv, "command_for", command_for)
    old = sup.procs["rollout"]
    old.send_signal(signal.SIGKILL)
    old.wait()
    deadline = time.monotonic() + 10
    while sup.procs["rollout"] is old and time.monotonic() < deadline:
        sup.watch()
        time.sleep(0.05)
    assert built == ["rollout", "rollout"]  # failed once, then started
    assert sup.procs["rollout"] is not old and sup.procs["rollout"].poll() is None
    assert sup.procs["gateway"].poll() is None


def test_a_stop_goes_on_past_a_process_that_does_not_die(sup, monkeypatch):
    """A process stuck in the kernel (a GPU driver call) outlives SIGKILL for a while: the
    other roles, Redis among them, are stopped all the same."""
    import subprocess

    stuck = sup.procs["gateway"]
    real_wait = stuck.wait

    def wait(timeout=None):
        raise subprocess.TimeoutExpired(stuck.args, timeout)

    monkeypatch.setattr(stuck, "wait", wait)
    rollout = sup.procs["rollout"]
    sup.stop(grace=0.2)
    assert rollout.poll() is not None  # stopped, though the gateway did not say it was
    real_wait(5)


def test_a_role_log_past_its_limit_is_rotated_when_the_role_starts(tmp_path, monkeypatch):
    """A stack that runs for weeks, its roles restarted now and then: each log is kept to
    about ``LOG_ROTATE_BYTES`` (the one before is kept as ``<role>.log.1``), and the tail a
    failure shows is read from the end, not the whole file."""
    monkeypatch.setattr(sv, "LOG_ROTATE_BYTES", 1000)
    # the session's own ports: a user's stack may be running on the defaults
    s = sv.Supervisor(load_config(None, env_overrides()), log_dir=tmp_path)
    log = s.log_path("rollout")
    log.write_bytes(b"old line\n" * 200)  # 1800 bytes: past the limit
    try:
        s._spawn(Command("rollout", ["sh", "-c", "echo fresh; sleep 60"]))
        deadline = time.monotonic() + 10
        while "fresh" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.read_text() == "fresh\n"
        assert (tmp_path / "rollout.log.1").read_bytes() == b"old line\n" * 200
        assert s._tail("rollout") == "fresh"
    finally:
        s.stop(grace=2)

"""Start the stack's processes, wait until each is healthy, keep them running, stop them
in order.

Unlike honcho (which signals everything at once and kills after 5 s), the supervisor stops
roles in reverse start order and gives Celery a warm shutdown, so Redis is the last to go
and nothing is left running. Each process runs in its own process group so that its
children (vLLM's engine core, gunicorn's workers, Celery's pool) go with it.

A role that exits while the stack runs is started again (``watch``), after a backoff that
doubles on each quick failure; its peers carry on meanwhile (a dead rollout worker's tasks
are requeued by the others, a dead trainer's step is re-sent by the driver). Restarts are
logged and counted in Redis for ``carryover status``, and each exit is recorded there with
what ended it (``app.services.exits``: a signal, an exit code, the kernel's OOM kill), which
the driver names when a step kept killing the trainer. Only a role that keeps failing right
after its start (``MAX_QUICK_FAILURES`` times in a row) stops the stack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from app.config.loader import REPO_ROOT
from app.config.schema import Config
from app.services import exits, health
from app.services.commands import ROLES, Command, command_for

if TYPE_CHECKING:
    import redis

    from app.state.records import RoleExit

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


class RoleFailing(RuntimeError):
    """A role kept exiting right after being started again."""


MAX_QUICK_FAILURES = 5
QUICK_S = 30.0        # a role that dies within this long after its start failed "quickly"
BACKOFF_S = (1.0, 30.0)  # first and longest wait before a restart
LOG_ROTATE_BYTES = 256 * 2**20  # a role's log past this is rotated when the role starts
EXITS_UNWRITTEN = 100  # exits kept while Redis cannot take them (the newest)


def _ready_check(cfg: Config, role: str) -> Callable[[], bool]:
    """A quick look at whether ``role`` answers (its health check)."""
    if role == "redis":
        return lambda: health.check_redis(cfg, timeout=1).ok
    if role == "inference":
        return lambda: all(p.ok for p in health.check_inference(cfg, timeout=1))
    if role == "gateway":
        return lambda: health.check_gateway(cfg, timeout=1).ok
    if role == "flower":
        return lambda: health.check_flower(cfg, timeout=1).ok
    queue = role

    def worker_up() -> bool:
        return any(p.ok for p in health.check_workers(timeout=1) if p.part == f"worker:{queue}")

    return worker_up


def wait_ready(cfg: Config, roles: Iterable[str], timeout: float,
               progress: Callable[[str], None] | None = None,
               before_look: Callable[[str], None] | None = None) -> list[str]:
    """Look at each role's health every 0.5 s until every one answers or ``timeout`` has
    passed; returns the roles that never answered. ``progress(role)`` hears each role that
    answered; ``before_look(role)`` runs before each look (to raise for a role that died)."""
    pending = {r: _ready_check(cfg, r) for r in roles}
    deadline = time.monotonic() + timeout
    while pending:
        for role in list(pending):
            if before_look:
                before_look(role)
            if pending[role]():
                del pending[role]
                if progress:
                    progress(role)
        if pending and time.monotonic() > deadline:
            break
        if pending:
            time.sleep(0.5)
    return list(pending)


def _listen_address(cfg: Config, role: str) -> tuple[str, int, str] | None:
    """(host, port, config key) a role's server binds to, for the roles that listen."""
    if role == "redis":
        return cfg.redis.host, int(cfg.redis.port), "redis.port"
    if role == "inference":
        return cfg.inference.host, int(cfg.inference.port), "inference.port"
    if role == "gateway":
        return cfg.gateway.host, int(cfg.gateway.port), "gateway.port"
    if role == "flower":
        return "127.0.0.1", int(cfg.services.flower_port), "services.flower_port"
    return None


def _in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1",
                                port)) == 0


class Supervisor:
    def __init__(self, cfg: Config, log_dir: Path | None = None, env: dict[str, str] | None = None):
        self.cfg = cfg
        self.log_dir = log_dir or (REPO_ROOT / "var" / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        os.environ.setdefault("CARRYOVER_ROLE", "supervisor")  # this process, in its records
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}
        self.quick_failures: dict[str, int] = {}
        self.restart_due: dict[str, float] = {}
        self.restarts: dict[str, int] = {}
        self.start_errors: dict[str, str] = {}  # why a role's last restart did not start
        self._groups_killed: set[subprocess.Popen] = set()  # exited roles' groups, killed
        self.counted: dict[str, int] = {}  # the totals Redis holds of self.restarts
        # this supervisor's own fields in the restart counts (several share one Redis)
        self.count_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._count_deferred = False
        self.oom_kills_at_start: dict[str, int | None] = {}  # the cgroup's, at each start
        self.kmsg_at_start: dict[str, int | None] = {}  # the kernel log's last record, too
        self.unwritten_exits: list[RoleExit] = []  # seen, not in Redis yet

    def log_path(self, role: str) -> Path:
        return self.log_dir / f"{role}.log"

    def _spawn(self, cmd: Command, port_wait_s: float = 0.0) -> None:
        """Start ``cmd``'s role; ``port_wait_s``: how long its port may take to be free (a
        restart: the role just killed may still hold it)."""
        if cmd.idle_reason:
            log.info("%s: not started (%s)", cmd.role, cmd.idle_reason)
            return
        address = _listen_address(self.cfg, cmd.role)
        deadline = time.monotonic() + port_wait_s
        while address is not None and _in_use(address[0], address[1]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # the killed role's sockets close as its processes go
        if address is not None and _in_use(address[0], address[1]):
            # Checked first: the readiness probe would otherwise find the other server and
            # call this one ready while it fails to bind.
            raise StartupError(
                f"{cmd.role}: port {address[1]} on {address[0]} is already in use (another "
                f"carryover stack still running or stopping?); "
                f"or choose another port with {address[2]}=...")
        try:
            self._rotate(self.log_path(cmd.role))
            logfile = open(self.log_path(cmd.role), "ab")  # noqa: SIM115 - owned by the child
        except OSError as exc:
            raise StartupError(f"{cmd.role}: cannot open its log {self.log_path(cmd.role)}: "
                               f"{exc.strerror or exc}") from exc
        # the kernel's witnesses as they stand before the start: what they show later is
        # this run of the role's
        oom_kills, kmsg_at = exits.cgroup_oom_kills(), exits.kmsg_position()
        try:
            proc = subprocess.Popen(
                # CARRYOVER_ROLE names the process in what it records (a Redis outage it rode)
                cmd.argv, cwd=REPO_ROOT, env={**self.env, **cmd.env, "CARRYOVER_ROLE": cmd.role},
                stdout=logfile,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:  # its program missing (an environment not set up) or not runnable
            raise StartupError(f"{cmd.role}: cannot run {cmd.argv[0]}: {exc.strerror or exc}"
                               ) from exc
        finally:
            logfile.close()
        self.procs[cmd.role] = proc
        self.started_at[cmd.role] = time.monotonic()
        self.oom_kills_at_start[cmd.role] = oom_kills
        self.kmsg_at_start[cmd.role] = kmsg_at
        log.info("%s: started pid %d (log %s)", cmd.role, proc.pid, self.log_path(cmd.role))

    @staticmethod
    def _rotate(path: Path) -> None:
        """A role's log past ``LOG_ROTATE_BYTES`` becomes ``<role>.log.1`` (replacing the one
        before) when the role (re)starts; a role that never restarts keeps writing to one."""
        try:
            if path.stat().st_size > LOG_ROTATE_BYTES:
                path.replace(path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass

    def _tail(self, role: str, lines: int = 15) -> str:
        """The log's last ``lines``, read from its end (a log may be large)."""
        try:
            with open(self.log_path(role), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, roles: Iterable[str], timeout: float,
                    progress: Callable[[str], None] | None = None) -> None:
        def exited(role: str) -> None:
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is not None:
                raise StartupError(f"{role} exited with code {proc.returncode} during start; "
                                   f"last lines of {self.log_path(role)}:\n{self._tail(role)}")

        down = wait_ready(self.cfg, [r for r in roles if r in self.procs or r == "redis"],
                          timeout, progress, exited)
        if down:
            raise StartupError(f"not healthy after {timeout:.0f}s: {', '.join(down)}; see "
                               + ", ".join(str(self.log_path(r)) for r in down))

    def start(self, roles: Iterable[str] = ROLES,
              progress: Callable[[str], None] | None = None) -> None:
        roles = [r for r in ROLES if r in set(roles)]
        # every command first: a setting a role cannot start with (a model path that holds
        # no model) is reported before any role has started
        commands = {role: command_for(self.cfg, role) for role in roles}
        try:
            if "redis" in roles:
                self._spawn(commands["redis"])
                self._wait_ready(["redis"], 30, progress)
            rest = [r for r in roles if r != "redis"]
            for role in rest:
                self._spawn(commands[role])
            timeout = float(self.cfg.inference.startup_timeout_s)
            self._wait_ready(rest, timeout, progress)
        except BaseException as exc:
            # said first: a role still loading may take its whole grace to stop
            log.warning("start %s: stopping the roles started so far (%s)",
                        "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                        ", ".join(self.procs) or "none")
            self.stop()
            raise

    def watch(self) -> list[str]:
        """One look at every role: schedule a restart for each that exited, start those whose
        backoff ran out. Returns the roles restarted now. Raises ``RoleFailing`` for a role
        that failed right after ``MAX_QUICK_FAILURES`` starts in a row."""
        restarted: list[str] = []
        try:
            self._look(restarted)
        finally:  # the restarts made before a role failed for good are counted too
            self._count_restarts()
            self._write_exits()
        return restarted

    def _look(self, restarted: list[str]) -> None:
        now = time.monotonic()
        for role, proc in list(self.procs.items()):
            if proc.poll() is None:
                if now - self.started_at.get(role, now) > QUICK_S:
                    self.quick_failures[role] = 0  # it ran: the next failure starts afresh
                continue
            if role not in self.restart_due:
                how = f"exited with code {proc.returncode}"
                if role not in self.start_errors:  # a new exit, not a failed restart's
                    record = exits.role_exit(role, proc, self.oom_kills_at_start.get(role),
                                             self.kmsg_at_start.get(role))
                    self.unwritten_exits.append(record)
                    del self.unwritten_exits[:-EXITS_UNWRITTEN]
                    how = f"exited ({record.describe()})"
                quick = now - self.started_at.get(role, now) <= QUICK_S
                self.quick_failures[role] = self.quick_failures.get(role, 0) + 1 if quick else 1
                if self.quick_failures[role] > MAX_QUICK_FAILURES:
                    if role in self.start_errors:
                        raise RoleFailing(f"{role} could not be started again "
                                          f"({self.start_errors[role]})")
                    raise RoleFailing(
                        f"{role} exited {MAX_QUICK_FAILURES + 1} times in a row within "
                        f"{QUICK_S:.0f} s of its start (last code {proc.returncode}); last "
                        f"lines of {self.log_path(role)}:\n{self._tail(role)}")
                delay = min(BACKOFF_S[0] * 2 ** (self.quick_failures[role] - 1), BACKOFF_S[1])
                self.restart_due[role] = now + delay
                log.warning("%s %s; starting it again in %.0f s (the other roles carry on)",
                            role, "could not be started" if role in self.start_errors
                            else how, delay)
            elif now >= self.restart_due[role]:
                del self.restart_due[role]
                self._kill_leftovers(proc)
                try:
                    self._spawn(command_for(self.cfg, role), port_wait_s=2.0)
                except Exception as exc:  # noqa: BLE001 - a config error too (a model dir
                    # briefly unreadable) is one failed start, not the end of every role:
                    # as an exit at once, the same backoff, and RoleFailing as many times on
                    self.started_at[role] = now
                    self.start_errors[role] = str(exc)
                    log.warning("%s could not be started again: %s", role, exc)
                    continue
                self.start_errors.pop(role, None)
                self.restarts[role] = self.restarts.get(role, 0) + 1
                restarted.append(role)

    @property
    def uncounted(self) -> dict[str, int]:
        """Restarts per role that Redis does not hold yet."""
        return {role: n - self.counted.get(role, 0) for role, n in self.restarts.items()
                if n != self.counted.get(role, 0)}

    def _count_restarts(self) -> None:
        """Write the restarts not counted yet where ``carryover status`` reads them. One
        quick try per look, never a wait: Redis may be the role that is down, waiting for
        this very loop to start it again (a client that rode out the outage held the loop,
        and the restart of Redis with it, for the whole reconnect window). What Redis could
        not take now is written at a later look. Each role's total is written, not added
        to: a write made again after its reply was lost (slower than 1 s) counts once. Every
        role's total goes with each write, so the write that counts a restart of Redis puts
        back what its AOF lost (a Redis elsewhere, restarted by others, may lose counts)."""
        if not self.uncounted:
            return
        from app.state import keys

        try:
            with self._redis_once() as client:
                client.hset(keys.role_restarts(), mapping={
                    keys.role_restarts_field(role, self.count_id): n
                    for role, n in self.restarts.items()})
        except Exception as exc:  # noqa: BLE001 - counting must never stop a restart
            # said once per wait, not at every look
            (log.debug if self._count_deferred else log.info)(
                "restarts not counted in Redis yet, counted once it answers (%s): %s",
                dict(self.uncounted), exc)
            self._count_deferred = True
            return
        self.counted = dict(self.restarts)
        self._count_deferred = False

    def _write_exits(self) -> None:
        """Record the exits seen and not yet recorded, one quick try per look as for the
        counts (and for the same reason); what Redis could not take waits for a later look.
        An exit whose reply was lost is recorded twice; the driver counts it once."""
        if not self.unwritten_exits:
            return
        try:
            with self._redis_once() as client:
                while self.unwritten_exits:
                    exits.write_exit(client, self.unwritten_exits[0])
                    self.unwritten_exits.pop(0)
        except Exception as exc:  # noqa: BLE001 - recording must never stop a restart
            log.debug("%d exit(s) not recorded in Redis yet: %s", len(self.unwritten_exits),
                      exc)

    @contextlib.contextmanager
    def _redis_once(self) -> Iterator[redis.Redis]:
        """A client that tries each command once, with a 1 s timeout, and is closed after."""
        from app.state.connection import connect, resolve_redis_url

        client = connect(resolve_redis_url(self.cfg), retry=None, socket_timeout=1,
                         socket_connect_timeout=1)
        try:
            yield client
        finally:
            client.connection_pool.disconnect()

    def watch_forever(self, every_s: float = 1.0,
                      stop: Callable[[], bool] = lambda: False,
                      each: Callable[[], None] | None = None) -> None:
        """``watch`` every ``every_s`` until ``stop``; ``each`` after every look (it must
        not raise, nor wait long)."""
        while not stop():
            self.watch()
            if each is not None:
                each()
            time.sleep(every_s)

    def stop(self, grace: float = 20.0) -> None:
        """Stop in reverse start order: each gets SIGTERM, then SIGKILL after ``grace``.
        A second Ctrl-C while stopping is ignored so the stop always completes."""
        import threading

        saved = None
        if threading.current_thread() is threading.main_thread():
            saved = {s: signal.signal(s, signal.SIG_IGN)
                     for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self._stop(grace)
        finally:
            for s, h in (saved or {}).items():
                signal.signal(s, h)

    def _stop(self, grace: float) -> None:
        for role in reversed(list(self.procs)):
            proc = self.procs[role]
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs; killing", role, grace)
                    _signal_group(proc, signal.SIGKILL)
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        # stuck in the kernel (a GPU driver call): the other roles, Redis
                        # among them, are stopped all the same
                        log.error("%s (pid %d) outlived SIGKILL; going on without it", role,
                                  proc.pid)
            self._kill_leftovers(proc)  # children that outlived their leader (a pool process)
        self.procs.clear()
        self.restart_due.clear()

    def _kill_leftovers(self, proc: subprocess.Popen) -> None:
        """SIGKILL the group of a role's process that exited, once: after that its pid (the
        group's id) may be another process's."""
        if proc not in self._groups_killed:
            _signal_group(proc, signal.SIGKILL)
            self._groups_killed.add(proc)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

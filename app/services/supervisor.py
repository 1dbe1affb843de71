"""Start the stack's processes, wait until each is healthy, stop them in order.

Unlike honcho (which signals everything at once and kills after 5 s), the supervisor stops
roles in reverse start order and gives Celery a warm shutdown, so Redis is the last to go
and nothing is left running. Each process runs in its own process group so that its
children (vLLM's engine core, gunicorn's workers, Celery's pool) go with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from app.config.loader import REPO_ROOT
from app.services import health
from app.services.commands import ROLES, Command, command_for

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


def _ready_check(cfg: Any, role: str) -> Callable[[], bool]:
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


def _listen_address(cfg: Any, role: str) -> tuple[str, int, str] | None:
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
    def __init__(self, cfg: Any, log_dir: Path | None = None, env: dict[str, str] | None = None):
        self.cfg = cfg
        self.log_dir = log_dir or (REPO_ROOT / "var" / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, role: str) -> Path:
        return self.log_dir / f"{role}.log"

    def _spawn(self, cmd: Command) -> None:
        if cmd.idle_reason:
            log.info("%s: not started (%s)", cmd.role, cmd.idle_reason)
            return
        address = _listen_address(self.cfg, cmd.role)
        if address is not None and _in_use(address[0], address[1]):
            # Checked first: the readiness probe would otherwise find the other server and
            # call this one ready while it fails to bind.
            raise StartupError(
                f"{cmd.role}: port {address[1]} on {address[0]} is already in use (another "
                f"carryover stack still running or stopping?); "
                f"or choose another port with {address[2]}=...")
        logfile = open(self.log_path(cmd.role), "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd.argv, cwd=REPO_ROOT, env={**self.env, **cmd.env}, stdout=logfile,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        logfile.close()
        self.procs[cmd.role] = proc
        log.info("%s: started pid %d (log %s)", cmd.role, proc.pid, self.log_path(cmd.role))

    def _tail(self, role: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path(role).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_ready(self, roles: Iterable[str], timeout: float,
                    progress: Callable[[str], None] | None = None) -> None:
        pending = {r: _ready_check(self.cfg, r) for r in roles
                   if r in self.procs or (r == "redis")}
        deadline = time.monotonic() + timeout
        while pending:
            for role in list(pending):
                proc = self.procs.get(role)
                if proc is not None and proc.poll() is not None:
                    raise StartupError(f"{role} exited with code {proc.returncode} during start; "
                                       f"last lines of {self.log_path(role)}:\n{self._tail(role)}")
                if pending[role]():
                    del pending[role]
                    if progress:
                        progress(role)
            if pending and time.monotonic() > deadline:
                names = ", ".join(pending)
                raise StartupError(f"not healthy after {timeout:.0f}s: {names}; see "
                                   + ", ".join(str(self.log_path(r)) for r in pending))
            if pending:
                time.sleep(0.5)

    def start(self, roles: Iterable[str] = ROLES,
              progress: Callable[[str], None] | None = None) -> None:
        roles = [r for r in ROLES if r in set(roles)]
        try:
            if "redis" in roles:
                self._spawn(command_for(self.cfg, "redis"))
                self._wait_ready(["redis"], 30, progress)
            rest = [r for r in roles if r != "redis"]
            for role in rest:
                self._spawn(command_for(self.cfg, role))
            timeout = float(self.cfg.inference.startup_timeout_s)
            self._wait_ready(rest, timeout, progress)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 20.0) -> None:
        """Stop in reverse start order: each gets SIGTERM, then SIGKILL after ``grace``.
        A second Ctrl-C while stopping is ignored so the stop always completes."""
        import threading

        saved = None
        if threading.current_thread() is threading.main_thread():
            saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
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
                    proc.wait(timeout=5)
            # Children that outlived their leader (a pool process) go too.
            _signal_group(proc, signal.SIGKILL)
        self.procs.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

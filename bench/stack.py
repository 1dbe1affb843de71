"""A private stack for one benchmark: free ports, a temporary Redis directory, the roles it
needs started by the project's own supervisor (and stopped, whatever happens).

The overrides go into ``$CARRYOVER_OVERRIDES`` before any project module builds the Celery
app, so the benchmark process and every worker it starts agree on the ports.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMO_CONFIG = REPO / "config" / "demo.yaml"


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, never one this process was given before: the kernel may hand the
    same ephemeral port to two binds in a row once the first socket is closed, and two
    services of one stack must not share one (the config refuses it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def stack_overrides(tmp: Path, *extra: str) -> list[str]:
    ports = {k: free_port() for k in ("redis", "inference", "gateway", "flower")}
    return [f"redis.port={ports['redis']}", f"redis.dir={tmp / 'redis'}",
            f"inference.port={ports['inference']}",
            f"inference.urls=[http://127.0.0.1:{ports['inference']}]",
            f"gateway.port={ports['gateway']}",
            f"gateway.url=http://127.0.0.1:{ports['gateway']}",
            f"services.flower_port={ports['flower']}", *extra]


@contextmanager
def bench_dir() -> Iterator[Path]:
    """A temporary directory for one benchmark's logs, Redis data and exports: removed when
    the benchmark ends well, kept (and named on stderr) when it fails."""
    tmp = Path(tempfile.mkdtemp(prefix="carryover-bench-"))
    try:
        yield tmp
    except BaseException:
        print(f"the benchmark's logs and data are kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


# a directory: the benchmark uses the stack $CARRYOVER_OVERRIDES describes, and this directory
ATTACH_ENV = "CARRYOVER_BENCH_ATTACH"
ATTACH_WAIT_S = 30.0  # how long each role has to answer


@contextmanager
def bench_stack(roles: list[str], *extra: str) -> Iterator[tuple[list[str], Path]]:
    """Start ``roles``; yields (the overrides every run config must include, a temp dir).

    With ``$CARRYOVER_BENCH_ATTACH`` set to a directory, nothing is started: the roles must
    already be up where ``$CARRYOVER_OVERRIDES`` says (the test suite's stack, which saves
    each benchmark's smoke test a start of every role), and ``extra``'s service settings
    are not applied. The directory is kept: the attached stack may still read files the
    benchmark wrote there (its weights)."""
    attach = os.environ.get(ATTACH_ENV)
    if attach:
        yield _attached(Path(attach), roles, extra), Path(attach)
        return
    with bench_dir() as tmp, _started(tmp, roles, *extra) as base:
        yield base, tmp


def _attached(tmp: Path, roles: list[str], extra: tuple[str, ...]) -> list[str]:
    from app.config import service_config
    from app.services.supervisor import wait_ready

    # a few looks each, as the supervisor waits: one slow answer on a loaded machine (the
    # solo trainer worker busy with a task, a 1 s health call) is not a role that is down
    down = wait_ready(service_config(), roles, ATTACH_WAIT_S)
    if down:
        raise RuntimeError(f"{ATTACH_ENV} is set, but these roles of the stack "
                           f"$CARRYOVER_OVERRIDES describes are not up: {', '.join(down)}")
    if extra:
        print(f"# attached to a running stack: its own settings stand, not {list(extra)}",
              file=sys.stderr)
    tmp.mkdir(parents=True, exist_ok=True)
    return json.loads(os.environ.get("CARRYOVER_OVERRIDES") or "[]")


@contextmanager
def _started(tmp: Path, roles: list[str], *extra: str) -> Iterator[list[str]]:
    base = stack_overrides(tmp, *extra)
    os.environ.pop("REDIS_URL", None)
    os.environ["CARRYOVER_OVERRIDES"] = json.dumps(base)
    os.environ.setdefault("CARRYOVER_ADMIN_TOKEN", "bench")
    from app.config import service_config
    from app.services.supervisor import Supervisor

    with Supervisor(service_config(), log_dir=tmp / "logs",
                    env={"PYTHONPATH": str(REPO)}) as sup:
        sup.start(roles)
        yield base


@dataclass
class UpStack:
    """``carryover up`` running: the environment its commands share, its config, its process
    and its log."""
    env: dict[str, str]
    cfg: Any
    up: Any  # subprocess.Popen
    log: Path

    def log_since(self, offset: int) -> str:
        return self.log.read_text()[offset:]

    def role(self, match: Callable[[list[str]], bool]) -> Any:
        """The running child (a psutil.Process) whose command line ``match`` accepts: a
        role just killed stays a zombie until the supervisor's next look, and is skipped."""
        import psutil

        for child in psutil.Process(self.up.pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and match(child.cmdline()):
                    return child
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
        raise LookupError("no such role running under carryover up")

    def kill_role(self, match: Callable[[list[str]], bool]) -> None:
        """SIGKILL the role's process group (the role and what it started)."""
        import signal

        os.killpg(self.role(match).pid, signal.SIGKILL)


def is_redis(cmd: list[str]) -> bool:
    return "redis-server" in " ".join(cmd)


def is_rollout_worker(cmd: list[str]) -> bool:
    return "-Q" in cmd and "rollout" in cmd


@contextmanager
def carryover_up(overrides: list[str], log: Path, config: Path = DEMO_CONFIG,
                 timeout: float = 240) -> Iterator[UpStack]:
    """``carryover up`` on ``config`` with ``overrides`` (its ports among them:
    :func:`stack_overrides`), its output in ``log``; yields once it says every part is up,
    and stops it (SIGINT; after 90 s SIGKILL to it and each role) on the way out. The stack's
    own Redis is the one this process talks to as well: ``$REDIS_URL`` is dropped."""
    import contextlib
    import signal
    import subprocess
    import time

    import psutil

    from app.config import load_config

    redis_url = os.environ.pop("REDIS_URL", None)
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides),
           "CARRYOVER_CONFIG": str(config)}
    cfg = load_config(str(config), overrides)
    with open(log, "w") as out, _restored_redis_url(redis_url):
        up = subprocess.Popen([str(BIN / "carryover"), "up"], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while "all parts up" not in log.read_text():
                if up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("carryover up "
                                       + ("exited" if up.poll() is not None else
                                          f"was not up in {timeout:.0f} s")
                                       + f":\n{log.read_text()[-3000:]}")
                time.sleep(1)
            yield UpStack(env, cfg, up, log)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it may have exited
                os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(90)
            except subprocess.TimeoutExpired:
                # each role runs in a session of its own, out of reach of the first kill
                roles: list[psutil.Process] = []
                with contextlib.suppress(psutil.Error):
                    roles = psutil.Process(up.pid).children()
                for pid in [up.pid, *(r.pid for r in roles)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                up.wait(10)


@contextmanager
def _restored_redis_url(url: str | None) -> Iterator[None]:
    try:
        yield
    finally:
        if url is not None:
            os.environ["REDIS_URL"] = url


def redis_calls(client) -> int:
    """Commands the server has executed so far (every client: driver, workers, Celery)."""
    return sum(int(v["calls"]) for v in client.info("commandstats").values())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


@contextmanager
def inference_server(cfg, log: Path, timeout: float = 300) -> Iterator[tuple[str, object]]:
    """The inference server ``cfg`` describes (the project's own command line), on
    ``cfg.inference.port``; yields (its URL, its Popen) once it answers /health, and stops
    it (SIGKILL after 30 s) on the way out."""
    with inference_servers([(cfg, log)], timeout) as [served]:
        yield served


@contextmanager
def inference_servers(servers: list[tuple[object, Path]], timeout: float = 300
                      ) -> Iterator[list[tuple[str, object]]]:
    """Several inference servers, each ``(cfg, log)`` as :func:`inference_server` takes,
    started together (a start is mostly imports, one core each) rather than one after
    another; yields their (URL, Popen) in order once every one answers /health."""
    import subprocess
    import time

    import requests

    from app.services.commands import inference_command

    procs: list[tuple[str, subprocess.Popen, Path]] = []
    try:
        for cfg, log in servers:
            cmd = inference_command(cfg)
            with open(log, "w") as out:
                procs.append((f"http://127.0.0.1:{cfg.inference.port}", subprocess.Popen(
                    cmd.argv, env={**os.environ, **cmd.env}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + timeout
        for url, proc, log in procs:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the inference server exited: "
                                       f"{log.read_text()[-2000:]}")
                try:
                    if requests.get(url + "/health", timeout=1).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the inference server did not answer /health in "
                                       f"{timeout:.0f} s (log: {log})")
                time.sleep(1)
        yield [(url, proc) for url, proc, _ in procs]
    finally:
        for _, proc, _ in procs:
            _stop_group(proc)


def _stop_group(proc) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    import contextlib
    import signal
    import subprocess

    # the group may be gone already (a test that killed the server)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

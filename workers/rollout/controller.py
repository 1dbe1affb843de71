"""Controllers: how one agent execution is started, watched and stopped.

A controller gets the task sample and an LLM endpoint (per-rollout base URL, token, model
name) and returns a float reward, or raises :class:`AgentError`. Backends:

- ``python``: a callable ``module:function(sample, llm, **agent_settings) -> float`` run
  in a thread of the rollout worker.
- ``process``: any executable; the endpoint arrives in its environment, the sample on stdin
  (and in ``$CARRYOVER_SAMPLE`` up to ``SAMPLE_ENV_MAX_BYTES``); its reward is a POST to
  ``<gateway>/rollout/<id>/reward`` or else the last JSON line on stdout (a number or
  ``{"reward": x}``); its process group is killed when it ends, times out or is cancelled.
- ``kubernetes``: one Kubernetes Job per attempt (``workers.rollout.kubernetes``); the
  agent gets the same environment as a process and POSTs its reward to the gateway.

Timeouts do not count time the gateway spent paused: a weight update must not fail agents.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypedDict, Unpack

import redis

from app.state import keys
from app.state.records import RolloutRecord
from workers.rollout.base import (
    AgentError,
    Controller,
    LLMEndpoint,
    PauseAwareClock,
    fits_environment,
    parse_reward,
    stop_reason,
)

if TYPE_CHECKING:
    from app.config.schema import KubernetesConfig

log = logging.getLogger(__name__)

__all__ = ["AgentError", "Controller", "LLMEndpoint", "PauseAwareClock", "ProcessController",
           "PythonController", "make_controller", "parse_reward", "stop_reason"]


class PythonController(Controller):
    def __init__(self, ref: str, settings: dict[str, object]) -> None:
        module, _, name = ref.partition(":")
        try:
            self.fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise AgentError(f"controller.agent {ref!r} cannot be loaded: {exc}") from None
        self.settings = settings

    def run(self, sample: dict[str, object], llm: LLMEndpoint, timeout_s: float,
            clock: PauseAwareClock, cancelled: Callable[[], bool],
            posted_reward: Callable[[], object] = lambda: None, adopted: bool = False) -> float:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = self.fn(sample, llm, **self.settings)
            except BaseException as exc:  # noqa: BLE001 - reported as the attempt's error
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"agent-{llm.rollout_id}", daemon=True)
        thread.start()
        while thread.is_alive():
            # Coarse ticks: many agents share one worker process and its GIL (the join
            # returns at once when the agent ends; only timeout and cancel wait a tick).
            thread.join(1.0)
            reason = stop_reason(clock, timeout_s, cancelled)
            if reason:
                # A thread cannot be killed; the rollout is closed in the gateway instead,
                # so the abandoned agent's next model call fails and it ends.
                raise AgentError(reason)
        if "error" in box:
            exc = box["error"]
            raise AgentError(f"agent raised {exc.__class__.__name__}: {str(exc)[:ERROR_CHARS]}")
        return parse_reward(box.get("value"))


# What is kept of a process agent's stdout and stderr: the reward is its last line, and the
# error message shows the tail. An agent that logs gigabytes must not fill the worker.
OUTPUT_TAIL_BYTES = 64 * 1024


class _Tail:
    """Reads a pipe to its end in a thread, keeping only its last ``limit`` bytes."""

    POLL_S = 0.2  # how soon the reader sees it was told to stop
    THREAD_NAME = "agent-output-reader"

    def __init__(self, stream: IO[bytes], limit: int = OUTPUT_TAIL_BYTES) -> None:
        self.stream, self.limit = stream, limit
        self.buf = bytearray()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name=self.THREAD_NAME, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        fd = self.stream.fileno()
        poller = select.poll()  # not select(): a busy worker's fds pass FD_SETSIZE
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            while not self._stop.is_set():
                if not poller.poll(self.POLL_S * 1000):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    return
                self.buf += chunk
                if len(self.buf) > 2 * self.limit:
                    del self.buf[:-self.limit]
        finally:
            self.stream.close()

    def text(self, by: float) -> str:
        """What was read by ``by`` (a ``time.monotonic()`` deadline). A process that escaped
        the group (``setsid``, a daemon) may hold the pipe open for ever: the reader is then
        told to stop, and ends within ``POLL_S`` instead of staying blocked with its fd."""
        self.thread.join(max(0.0, by - time.monotonic()))
        self._stop.set()
        self.thread.join(2 * self.POLL_S)
        return bytes(self.buf[-self.limit:]).decode("utf-8", "replace")


def _feed(stream: IO[bytes], data: bytes) -> None:
    """Write the sample to the agent's stdin and close it, in a thread: an agent that never
    reads a sample larger than the pipe's buffer must not block its timeout."""
    def write() -> None:
        try:
            stream.write(data)
        except OSError:  # the agent exited or closed its stdin: it did not want the sample
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    threading.Thread(target=write, daemon=True).start()


# Environment variables a worker may hold that an agent must not: they reach Redis (where
# an agent could write its own reward), the servers past the gateway, or its admin routes.
WORKER_SECRETS = ("REDIS_URL", "REDIS_PASSWORD", "CARRYOVER_ADMIN_TOKEN",
                  "CARRYOVER_INFERENCE_API_KEY", "VLLM_API_KEY", "CARRYOVER_OVERRIDES",
                  "CARRYOVER_CONFIG")
# the most of an agent's error message kept (in logs, the group's results, the quarantine)
ERROR_CHARS = 2000


def agent_environment() -> dict[str, str]:
    """The worker's environment without its secrets: what a process agent starts with."""
    return {k: v for k, v in os.environ.items() if k not in WORKER_SECRETS}


def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None (gone, not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from its end
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


class ProcessController(Controller):
    def __init__(self, command: str, settings: dict[str, object],
                 client: redis.Redis | None = None) -> None:
        self.command = command
        self.settings = settings
        self.client = client  # where the agent's process group is recorded (stop() reads it)

    def _record(self, rollout_id: str, pid: int) -> None:
        started = _start_ticks(pid)
        if self.client is None or started is None:
            return
        try:
            self.client.hset(keys.rollout(rollout_id), mapping={
                RolloutRecord.field("agent_host"): socket.gethostname(),
                RolloutRecord.field("agent_pid"): pid,
                RolloutRecord.field("agent_started"): started})
        except redis.RedisError as exc:  # the agent runs on; only a later stop() misses it
            log.warning("rollout %s: its agent's process group not recorded: %s", rollout_id,
                        exc)

    def stop(self, rollout_id: str) -> None:
        """Kill the process group of an agent an earlier delivery of this task started on
        this host, if it is still that one (its dead worker's ``finally`` never ran: the
        agent would run on with no timeout)."""
        if self.client is None:
            return
        host, pid, started = self.client.hmget(keys.rollout(rollout_id), [
            RolloutRecord.field(f) for f in ("agent_host", "agent_pid", "agent_started")])
        if host != socket.gethostname() or not pid or not started:
            return
        if _start_ticks(int(pid)) != started:
            return  # it ended; the pid may be another process's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)
            log.warning("rollout %s: killed the agent process group %s its dead worker left "
                        "running", rollout_id, pid)

    def run(self, sample, llm, timeout_s, clock, cancelled, posted_reward=lambda: None,
            adopted=False):
        sample_json = json.dumps(sample)
        env = {**agent_environment(), **llm.env(),
               "CARRYOVER_AGENT_SETTINGS": json.dumps(self.settings)}
        if fits_environment(sample_json):
            env["CARRYOVER_SAMPLE"] = sample_json
        try:
            proc = subprocess.Popen(self.command, shell=True, env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:  # E2BIG (settings too large), no shell, no memory
            raise AgentError(f"agent process could not be started: {exc}") from None
        reason = None
        try:
            self._record(llm.rollout_id, proc.pid)
            out, err = _Tail(proc.stdout), _Tail(proc.stderr)
            _feed(proc.stdin, (sample_json + "\n").encode())
            while proc.poll() is None:
                time.sleep(0.2)
                if proc.poll() is not None:  # it ended in time: no timeout to report
                    break
                reason = stop_reason(clock, timeout_s, cancelled)
                if reason:
                    break
        finally:
            # The whole process group goes, also when the agent exited by itself (a child it
            # left running would hold the pipes open and outlive its rollout) and when
            # watching it failed (the attempt is retried: two agents must not run).
            _kill_group(proc)
        by = time.monotonic() + 2.0
        stdout, stderr_tail = out.text(by), err.text(by)[-2000:]
        if reason:
            raise AgentError(reason, stderr_tail)
        if proc.returncode != 0:
            raise AgentError(f"agent exited with code {proc.returncode}", stderr_tail)
        posted = posted_reward()
        if posted is not None:  # an explicit POST to the gateway wins over stdout
            return parse_reward(posted)
        for line in reversed(stdout.splitlines()):
            line = line.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, an int past Python's digit
                # limit, nesting past the recursion limit
                raise AgentError(f"agent's last stdout line is not JSON: "
                                 f"{line[:200]!r}", stderr_tail) from None
            return parse_reward(value)
        raise AgentError("agent exited without printing a reward", stderr_tail)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no member left that we may signal
        pass
    proc.wait(5)


class ControllerContext(TypedDict, total=False):
    """What a backend needs beyond the agent and its settings: ``client`` (process and
    kubernetes); all of them (kubernetes)."""

    client: redis.Redis
    kcfg: KubernetesConfig
    gateway_url: str
    run_id: str
    group_id: str
    index: int


def make_controller(backend: str, agent: str, settings: dict[str, object],
                    **context: Unpack[ControllerContext]) -> Controller:
    """``context``: client (process and kubernetes); kcfg, gateway_url, run_id, group_id,
    index (kubernetes)."""
    if backend == "python":
        return PythonController(agent, settings)
    if backend == "process":
        return ProcessController(agent, settings, context.get("client"))
    if backend == "kubernetes":
        from workers.rollout.kubernetes import KubernetesController

        return KubernetesController(agent, settings, **context)
    raise AgentError(f"controller.backend {backend!r} is unknown "
                     "(python, process or kubernetes)")

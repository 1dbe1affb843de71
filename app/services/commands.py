"""The command line of every process role, built from the configuration.

One source for the Procfile's ``carryover serve ROLE`` lines, the demo's supervisor and the
tests, so a role always starts the same way. Roles are listed in start order; stopping
goes in reverse (driver first, Redis last).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from app.config.errors import ConfigError
from app.config.loader import REPO_ROOT, model_dir, repo_path
from app.config.schema import Config, InferenceConfig
from app.config.secrets import check_shared_secret, inference_api_key
from app.config.settings import MAX_LORA_RANKS, lora_rank, sleep_mode, transfer_engine
from app.config.validate import is_loopback
from app.services.device import resolve as resolve_device
from app.services.rpc_sockets import rpc_dir, sweep
from app.services.transfer_wire import SHM_BACKEND
from app.state.connection import is_external

ROLES = ("redis", "inference", "gateway", "groups", "rollout", "trainer", "flower")


@dataclass(frozen=True)
class Command:
    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # A role with nothing to run (external Redis) still has a Procfile line; it idles.
    idle_reason: str | None = None


def _bin(venv: str, name: str) -> str:
    path = REPO_ROOT / venv / "bin" / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    return found or str(path)


def project_bin(name: str) -> str:
    """An executable of the project environment (the one running this code, else .venv)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else _bin(".venv", name)


# the embedded Redis's password, in its data directory (mode 0600)
AUTH_CONF = "auth.conf"


def redis_command(cfg: Config) -> Command:
    if is_external(cfg):
        return Command("redis", [], idle_reason="external Redis ($REDIS_URL or redis.url)")
    check_shared_secret(cfg, "redis")
    data_dir = (REPO_ROOT / cfg.redis.dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        project_bin("redis-server"),
        "--bind", cfg.redis.host,
        "--port", str(cfg.redis.port),
        "--dir", str(data_dir),
        # AOF: every write is logged, so a Redis restart keeps the run's groups, leases and
        # captures; fsynced each second (a machine crash can lose the last second, which the
        # roles redo or detect: docs/operations.md) or, with always, before each reply.
        "--appendonly", "yes",
        "--appendfsync", str(cfg.redis.appendfsync),
        "--save", "",
        "--protected-mode", "yes",
    ]
    # The password goes in a config file of the owner's alone, never on the command line:
    # until redis-server sets its process title, any local process reads its arguments in
    # /proc/<pid>/cmdline. Rewritten on each start (the password may have changed); removed
    # when there is none. redis-server takes its config file first, then the options.
    conf = data_dir / AUTH_CONF
    password = cfg.redis.password or os.environ.get("REDIS_PASSWORD")
    if password:
        _write_private(conf, f"requirepass {_redis_quote(str(password))}\n")
        argv.insert(1, str(conf))
    else:
        conf.unlink(missing_ok=True)
    return Command("redis", argv)


def _redis_quote(value: str) -> str:
    """``value`` as one double-quoted argument of a Redis config file: printable ASCII as
    is, but for the quote and the backslash; those and every other byte as ``\\xHH``."""
    return '"' + "".join(chr(b) if 0x20 <= b < 0x7f and b not in b'"\\' else f"\\x{b:02x}"
                         for b in value.encode()) + '"'


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by its owner only from the start (a new
    file of mode 0600, renamed over the old one whatever that one's mode)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _port_of(url: str) -> int | None:
    parts = urlsplit(url)
    try:
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _check_reachable(cfg: Config, role: str) -> None:
    """The server a role starts on this host is one its URL reaches: a plain-HTTP loopback
    URL's port is the one it binds (a URL of another host, or an https one, may go through a
    proxy on another port). Otherwise `carryover up` would wait for it at the URL until its
    start timed out."""
    def direct(url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme == "http" and is_loopback(parts.hostname or "")

    if role == "inference":
        port, urls = int(cfg.inference.port), list(cfg.inference.urls)
        local = [u for u in urls if direct(u)]
        if local and port not in {_port_of(u) for u in local}:
            raise ConfigError([f"inference.port: value {port} is the port of no entry of "
                               f"inference.urls on this host ({', '.join(local)}): the server "
                               "started on it would never be reached"])
    elif role == "gateway":
        port, url = int(cfg.gateway.port), str(cfg.gateway.url)
        if direct(url) and _port_of(url) != port:
            raise ConfigError([f"gateway.port: value {port} is not the port of gateway.url "
                               f"({url}): agents and the trainer would look for the gateway "
                               "there"])


def inference_command(cfg: Config) -> Command:
    _check_reachable(cfg, "inference")
    check_shared_secret(cfg, "inference")
    inf = cfg.inference
    device = resolve_device(str(inf.device))
    argv = [
        _bin(".venv-vllm", "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir(cfg).resolve()),
        "--served-model-name", inf.served_model_name,
        "--host", inf.host,
        "--port", str(inf.port),
        "--dtype", inf.dtype,
        "--max-model-len", str(inf.max_model_len),
        "--logprobs-mode", inf.logprobs_mode,
        # A model's generation_config.json (top_k, top_p, repetition_penalty: Qwen2.5-Instruct
        # sets all three) would otherwise apply to every call that does not set them, and
        # the rollouts would be sampled from a distribution the trainer does not model.
        "--generation-config", "vllm",
        "--disable-uvicorn-access-log",
        *_serving_args(inf),
    ]
    # Dev mode exposes /collective_rpc (weight reload), /reset_prefix_cache and sleep/wake.
    # The key guards /v1 (agents reach the model through the gateway only); in the
    # environment, not the command line, where any user's `ps` would show it.
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_API_KEY": inference_api_key(cfg)}
    _add_weight_loading(cfg, device, argv, env)
    if inf.enforce_eager if inf.enforce_eager is not None else device == "cpu":
        argv.append("--enforce-eager")
    # vLLM never removes its IPC sockets: they go to a private directory, where each start
    # removes the dead ones (rpc_sockets)
    sockets = rpc_dir()
    sweep(sockets)
    env["VLLM_RPC_BASE_PATH"] = str(sockets)
    if device == "cuda":
        argv += _gpu_args(cfg, device)
    else:
        _add_cpu_engine(inf, argv, env)
    return Command("inference", argv, env)


def _serving_args(inf: InferenceConfig) -> list[str]:
    """How calls are served: batch size, chat template, tool calls."""
    argv = []
    if inf.max_num_seqs:
        argv += ["--max-num-seqs", str(inf.max_num_seqs)]
    if inf.chat_template:
        argv += ["--chat-template", str(repo_path(inf.chat_template))]
    if inf.tool_call_parser:
        argv += ["--tool-call-parser", inf.tool_call_parser]
        if inf.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
        argv += ["--tool-strict-level", inf.tool_strict_level]
    return argv


def _add_weight_loading(cfg: Config, device: str, argv: list[str], env: dict[str, str]
                        ) -> None:
    """What each update's weights need of the server: the weight-transfer routes and their
    engine, and LoRA adapters loaded at run time."""
    engine = transfer_engine(cfg, device) if cfg.inference.weight_sync == "transfer" \
        else None
    if engine is not None:
        # vLLM's weight-transfer routes: its own CUDA IPC engine, or the one the project
        # registers through its plugin (workers/inference), buckets in shared memory
        argv += ["--weight-transfer-config",
                 json.dumps({"backend": SHM_BACKEND if engine == "shm" else "ipc"})]
    if engine == "ipc":
        # the HTTP route takes the IPC handles pickled, which vLLM unpickles only with this
        # set: the dev routes must stay unreachable to all but the trainer (operations.md)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    rank = lora_rank(cfg)
    if rank:
        # each update's adapter is loaded at run time under a new name; the newest and the
        # one before it are served (a gateway process may still name the older one)
        argv += ["--enable-lora", "--max-lora-rank",
                 str(next(r for r in MAX_LORA_RANKS if r >= rank)),
                 "--max-loras", "2", "--max-cpu-loras", "3"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter


def _gpu_args(cfg: Config, device: str) -> list[str]:
    inf = cfg.inference
    argv = ["--gpu-memory-utilization", str(inf.gpu_memory_utilization),
            "--tensor-parallel-size", str(inf.tensor_parallel_size),
            "--data-parallel-size", str(inf.data_parallel_size)]
    if sleep_mode(cfg, device):
        argv.append("--enable-sleep-mode")
    if lora_rank(cfg):
        # each API server process keeps its own table of adapters: one, so every load and
        # every call reach the same one (vLLM starts one per data-parallel rank)
        argv += ["--api-server-count", "1"]
    return argv


def _add_cpu_engine(inf: InferenceConfig, argv: list[str], env: dict[str, str]) -> None:
    argv += [
        "--kv-cache-memory-bytes", str(inf.kv_cache_memory_bytes),
        # One device per server: the model runs in the engine process. The multiprocess
        # executor's worker busy-polls its shared-memory queue (sched_yield for a second
        # after every step), which costs a whole core on a small CPU machine.
        "--distributed-executor-backend", "uni",
    ]
    # lets the CPU platform keep the "uni" executor (it forces "mp" otherwise)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    threads = inf.cpu_threads
    if threads:
        # Bound to the last cores, so the trainer's threads (first cores) and the engine's
        # OpenMP threads do not spin against each other on a small machine.
        cores = os.cpu_count() or 1
        first = max(cores - threads, 0)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{cores - 1}" if cores - first > 1 \
            else str(first)
        env["OMP_NUM_THREADS"] = str(min(threads, cores))


def gateway_command(cfg: Config) -> Command:
    _check_reachable(cfg, "gateway")
    check_shared_secret(cfg, "gateway")
    argv = [
        project_bin("gunicorn"),
        "-c", str(REPO_ROOT / "gateway" / "gunicorn.conf.py"),
        "gateway:create_app()",
    ]
    return Command("gateway", argv)


def worker_command(cfg: Config, role: str) -> Command:
    base = [project_bin("celery"), "-A", "app", "worker", "-E", "--loglevel", "INFO"]
    if role == "rollout":
        # Threads: a rollout slot mostly waits on an agent (HTTP, a subprocess), so
        # slots are cheap and many fit on two cores. As many as
        # services.rollout_concurrency (app.celery_app.rollout_slots), as in the Procfile.
        extra = ["-Q", "rollout", "-n", "rollout@%h", "--pool", "threads"]
    elif role == "groups":
        extra = ["-Q", "groups", "-n", "groups@%h", "--pool", "threads", "-c", "2"]
    elif role == "trainer":
        check_shared_secret(cfg, role)
        # solo: the model and optimizer stay resident in this one process.
        extra = ["-Q", "trainer", "-n", "trainer@%h", "--pool", "solo"]
    else:
        raise ValueError(f"not a worker role: {role}")
    return Command(role, base + extra)


def flower_command(cfg: Config) -> Command:
    argv = [project_bin("celery"), "-A", "app", "flower", "--address=127.0.0.1",
            f"--port={cfg.services.flower_port}"]
    return Command("flower", argv, {"FLOWER_UNAUTHENTICATED_API": "true"})


def command_for(cfg: Config, role: str) -> Command:
    if role == "redis":
        return redis_command(cfg)
    if role == "inference":
        return inference_command(cfg)
    if role == "gateway":
        return gateway_command(cfg)
    if role in ("rollout", "groups", "trainer"):
        return worker_command(cfg, role)
    if role == "flower":
        return flower_command(cfg)
    raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")

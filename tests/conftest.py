"""Fixtures for real services: Redis, vLLM, the gateway under gunicorn, Celery workers.

Every test session gets its own ports and its own Redis data directory, set through
``$CARRYOVER_OVERRIDES`` before any project module is imported, so every process the tests
start (and the Celery app object in this process) agrees on them and a developer's running
stack on the default ports is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Idle OpenMP threads sleep instead of spinning (libgomp spins up to ~300k iterations after
# each parallel region). On 2 cores a test runs vLLM, the trainer and this process at once,
# and with tiny models every op is short, so spinning threads took a quarter of the CPU
# (measured on test_real_model: 128 -> 94 s of user CPU). Set before torch is loaded here
# or in any process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.stack import free_port  # noqa: E402
from bench.stack import stack_overrides as bench_stack_overrides  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def stack_overrides(tmp: Path) -> list[str]:
    """A stack of its own ports and data directory, as the benchmarks start one."""
    return bench_stack_overrides(tmp, "gateway.workers=2",
                                 # fault tests wait this long for a dead worker
                                 "services.worker_heartbeat_s=3")


# Named here, made in pytest_configure: a process that only imports this module (a test
# module's spawned subprocess or Ray worker) must not leave an empty directory behind.
_TMP = Path(tempfile.gettempdir()) / f"carryover-test-{secrets.token_hex(6)}"
os.environ.pop("REDIS_URL", None)
os.environ.pop("CARRYOVER_CONFIG", None)
os.environ["CARRYOVER_OVERRIDES"] = json.dumps(stack_overrides(_TMP))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["CARRYOVER_ADMIN_TOKEN"] = "test-admin-token"
# the key the test servers demand on /v1 (the gateway and the trainer send it)
os.environ["CARRYOVER_INFERENCE_API_KEY"] = "test-inference-key"
INFERENCE_AUTH = {"Authorization": "Bearer test-inference-key"}


@pytest.fixture(autouse=True, scope="session")
def _inference_api_key():
    """The weight-sync calls tests make in this process carry the servers' key too."""
    from workers.trainer import weights

    weights.use_api_key(os.environ["CARRYOVER_INFERENCE_API_KEY"])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupt_once(signum: int, frame: object) -> None:
    """A pytest-xdist worker: the first SIGTERM or SIGINT stops its tests; later ones (the
    controller passes its own on, and a terminal's Ctrl-C reaches every process of the
    group) are ignored, so that the teardown stops every service the fixtures started."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def _pass_on(signum: int, frame: object) -> None:
    """The pytest-xdist controller: interrupted itself, it gives its workers 10 s and then
    kills them, mid-teardown (a stack's roles get 20 s each to stop). So the first signal
    goes to the workers instead, and the run ends when they have torn down; a second one
    interrupts the controller at once."""
    import psutil

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for worker in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGTERM)


def pytest_configure(config: pytest.Config) -> None:
    # The stacks the fixtures start run in their own sessions. A pytest stopped with SIGTERM
    # (``timeout``, a CI runner) would exit without fixture teardown and leave them running;
    # as a KeyboardInterrupt, pytest still tears its fixtures down.
    if hasattr(config, "workerinput"):
        signal.signal(signal.SIGTERM, _interrupt_once)
        signal.signal(signal.SIGINT, _interrupt_once)
    elif getattr(config.option, "dist", "no") != "no" and getattr(
            config.option, "numprocesses", None):
        signal.signal(signal.SIGTERM, _pass_on)
        signal.signal(signal.SIGINT, _pass_on)
    else:
        signal.signal(signal.SIGTERM, _interrupt)
    _TMP.mkdir(mode=0o700)


_KEPT: list[str] = []  # the log directories this run keeps (its workers' too)


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown stopped the services
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A passing run leaves nothing in the temp directory (its Redis data and service logs
    # are a few MB a run); a failing one keeps them, and says where.
    # Under pytest-xdist each worker has a directory of its own and no terminal: it hands
    # the path to the controller (``workeroutput``), which names every kept one.
    passed = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if passed or not any(_TMP.iterdir()):  # nothing started, nothing to keep
        shutil.rmtree(_TMP, ignore_errors=True)
    else:
        _KEPT.append(str(_TMP / "logs"))
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["carryover_kept_logs"] = list(_KEPT)
    else:
        for kept in _KEPT:
            session.config.get_terminal_writer().line(f"\nservices' logs kept in {kept}")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    # heard twice for a worker that was interrupted (finished, then reported down)
    _KEPT.extend(kept for kept in getattr(node, "workeroutput", {}).get(
        "carryover_kept_logs", []) if kept not in _KEPT)


def pytest_unconfigure(config: pytest.Config) -> None:
    # a run that never got to its session (``--help``) made the directory empty
    with contextlib.suppress(OSError):
        _TMP.rmdir()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="skip tests marked slow (end-to-end through every process)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fast"):
        skip = pytest.mark.skip(reason="--fast given")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


# ``make test`` runs two pytest-xdist workers (``-n 2 --dist loadgroup``) and two groups of
# tests, one per worker, each in collection order: the multi-host tests, which spend most of
# their time waiting out partitions in network namespaces of their own, then the unit tests;
# and every other test. The serial suite kept 2 cores busy 40% of its wall time; with the
# multi-host tests alone in their group, the other group ran 10 minutes longer. The groups
# are set here by path: pytest-xdist's own ``xdist_group`` mark renames ``item._nodeid``,
# which pytest 9 no longer reads, so its groups never form. pytest-xdist sends each worker
# its whole group at once, so ``-x`` stops only the worker that failed.
SECOND_GROUP = re.compile(r"^tests/((faults|integration)/test_multihost|unit/)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TwoGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "second" if SECOND_GROUP.match(nodeid) else "first"

    return TwoGroups(config, log)


@pytest.fixture(scope="session")
def cfg():
    from app.config import service_config

    return service_config()


@pytest.fixture(scope="session")
def tmp_root() -> Path:
    (_TMP / "logs").mkdir(parents=True, exist_ok=True)  # every fixture that logs writes here
    return _TMP


@pytest.fixture(scope="session")
def supervisor(cfg, tmp_root) -> Iterator:
    from app.services.supervisor import Supervisor

    # PYTHONPATH: the rollout workers import the scripted agents in tests/agents.py.
    sup = Supervisor(cfg, log_dir=tmp_root / "logs", env={"PYTHONPATH": str(REPO)})
    yield sup
    sup.stop()


def _ensure(supervisor, *roles: str) -> None:
    missing = [r for r in roles if r not in supervisor.procs]
    if missing:
        supervisor.start(missing)


@pytest.fixture(scope="session")
def redis_service(supervisor, cfg):
    _ensure(supervisor, "redis")
    from app.state.connection import connect, resolve_redis_url

    return connect(resolve_redis_url(cfg))


@pytest.fixture
def redis_client(redis_service):
    """A clean slate of project keys (only ``co:*``; Celery's own keys stay)."""
    for key in redis_service.scan_iter("co:*", count=1000):
        redis_service.delete(key)
    return redis_service


@pytest.fixture(scope="session")
def vllm_service(supervisor, redis_service, cfg) -> str:
    _ensure(supervisor, "inference")
    return cfg.inference.urls[0]


@pytest.fixture(scope="session")
def gateway_service(supervisor, vllm_service, cfg) -> str:
    _ensure(supervisor, "gateway")
    return cfg.gateway.url


@pytest.fixture(scope="session")
def celery_workers(supervisor, redis_service):
    _ensure(supervisor, "groups", "rollout", "trainer")
    return supervisor


@pytest.fixture
def real_trainer():
    """A test that builds the trainer worker's resident trainer in this process: closed
    after it, so the next test starts without one."""
    yield
    from workers.trainer import resident

    if resident._resident is not None:
        resident._resident.close()
    resident._resident = None


@pytest.fixture
def new_rollout(redis_client, cfg):
    """Create rollouts the way the rollout task does; returns (rollout_id, token, base_url)."""
    from workers.rollout.episode import _start_attempt

    def make(gateway_url: str | None = None) -> tuple[str, str, str]:
        rid, token = _start_attempt(redis_client, "test-run", f"g{free_port()}", 0, 1)
        base = (gateway_url or cfg.gateway.url).rstrip("/")
        return rid, token, f"{base}/rollout/{rid}/v1"

    return make


@contextlib.contextmanager
def serving(handler: type) -> Iterator[str]:
    """An ``http.server`` request handler class served on a free loopback port, in a
    thread of this process; yields its URL."""
    import http.server
    import threading

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


def wait_rollouts_idle(client, timeout: float = 30) -> None:
    """Until no agent is in a model call (no live gateway lease), then half a second for
    those whose call just returned to reach their gate: a gate deleted while an agent is
    still in its call would hold that agent, and a shared worker's slot, for its two
    minutes. Leases expire on their own, so this is bounded however a test ended."""
    from app.state.pause import Pause

    pause = Pause(client)
    deadline = time.monotonic() + timeout
    while pause.live_leases() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)


def wait_http(url: str, timeout: float = 30) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=1).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@contextlib.contextmanager
def gateway_process(tmp_root: Path, name: str, urls: list[str], *overrides: str,
                    config: Path | None = None):
    """A gateway of its own (gunicorn, its own port) in front of the inference servers
    ``urls``, sharing the session's Redis, on ``config`` (the embedded defaults when None).
    Yields (gateway URL, gunicorn master Popen)."""
    import subprocess

    bin_dir = Path(sys.executable).parent
    (tmp_root / "logs").mkdir(parents=True, exist_ok=True)
    gw_port = free_port()
    env_overrides = json.loads(os.environ["CARRYOVER_OVERRIDES"]) + [
        f"gateway.port={gw_port}", f"gateway.url=http://127.0.0.1:{gw_port}",
        f"inference.urls=[{','.join(urls)}]", *overrides]
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(env_overrides)}
    if config is not None:
        env["CARRYOVER_CONFIG"] = str(config)
    with open(tmp_root / "logs" / f"{name}.log", "ab") as logs:
        gateway = subprocess.Popen(
            [str(bin_dir / "gunicorn"), "-c", "gateway/gunicorn.conf.py",
             "gateway:create_app()"],
            cwd=REPO, env=env, stdout=logs, stderr=logs, start_new_session=True)
    try:
        # its workers import the tokenizer's stack: on a loaded 2-core machine that has
        # taken over 30 s; one that died says why at once
        deadline = time.monotonic() + 120
        while True:
            try:
                wait_http(f"http://127.0.0.1:{gw_port}/healthz", 5)
                break
            except TimeoutError:
                log = (tmp_root / "logs" / f"{name}.log").read_text(errors="replace")
                assert gateway.poll() is None, f"gateway {name} exited:\n{log[-3000:]}"
                assert time.monotonic() < deadline, f"gateway {name} not up:\n{log[-3000:]}"
        yield f"http://127.0.0.1:{gw_port}", gateway
    finally:
        _stop(gateway)


def _stop(proc) -> None:
    import subprocess

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:  # a deliberately slow request is still open
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextlib.contextmanager
def standin_gateway(tmp_root: Path, name: str, *overrides: str, standins: int = 1):
    """A second gateway (gunicorn, its own port) in front of ``standins`` instant OpenAI
    stand-ins (``bench/standin.py``, ``standin_delay_s`` in a request makes it slow), sharing
    the session's Redis. Yields (gateway URL, gunicorn master Popen, [(stand-in URL,
    Popen)])."""
    import subprocess

    bin_dir = Path(sys.executable).parent
    (tmp_root / "logs").mkdir(parents=True, exist_ok=True)
    upstreams = []
    with open(tmp_root / "logs" / f"{name}.log", "ab") as logs:
        for _ in range(standins):
            port = free_port()
            upstreams.append((f"http://127.0.0.1:{port}", subprocess.Popen(
                [str(bin_dir / "gunicorn"), "-k", "gevent", "-w", "1", "-b",
                 f"127.0.0.1:{port}", "bench.standin:create_app()"], cwd=REPO, stdout=logs,
                stderr=logs, start_new_session=True)))
    try:
        for url, _ in upstreams:
            wait_http(f"{url}/health")
        with gateway_process(tmp_root, name, [u for u, _ in upstreams], *overrides) as (
                url, gateway):
            yield url, gateway, upstreams
    finally:
        for _, proc in upstreams:
            _stop(proc)


@contextlib.contextmanager
def model_server(model: Path, name: str, log_dir: Path, *overrides: str,
                 timeout: float = 300) -> Iterator[str]:
    """A vLLM server of its own (a free port) for ``model``, started with the project's
    inference command; yields its URL."""
    from app.config import load_config
    from bench.stack import inference_server

    port = free_port()
    cfg = load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                             f"actor_rollout_ref.model.path={model}", f"inference.port={port}",
                             f"inference.urls=[http://127.0.0.1:{port}]",
                             f"inference.served_model_name={name}", *overrides])
    with inference_server(cfg, log_dir / f"vllm-{name}.log", timeout) as (url, _):
        yield url


SMOLLM2 = REPO / "var" / "models" / "smollm2-135m-instruct"
SMOLLM2_NAME = "smollm2-135m-instruct"
# how config/arith.yaml serves it (bf16, 1024 tokens, the tool-aware chat template)
SMOLLM2_SERVING = ("inference.dtype=bfloat16", "inference.max_model_len=1024",
                   "inference.kv_cache_memory_bytes=268435456",
                   "inference.chat_template=config/templates/smollm2-tools.jinja")
# the session's server (``smollm2_server``): also with vLLM's weight-transfer routes on
# (weight_sync transfer), which a reload from disk does not use
SMOLLM2_SESSION_SERVING = (*SMOLLM2_SERVING, "inference.weight_sync=transfer")


@pytest.fixture(scope="session")
def smollm2_server(tmp_root, redis_service) -> Iterator[str]:
    """One vLLM CPU server of SmolLM2-135M-Instruct for the session (the real-model and the
    agent-SDK tests share it)."""
    assert (SMOLLM2 / "carryover-build.json").exists(), "scripts/setup.sh builds the model"
    with model_server(SMOLLM2, SMOLLM2_NAME, tmp_root / "logs",
                      *SMOLLM2_SESSION_SERVING) as url:
        yield url

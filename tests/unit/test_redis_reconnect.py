"""Clients from ``app.state.connection.connect`` ride out a Redis crash and restart (SIGKILL,
then the same port and AOF a few seconds later), blocking reads included, against real
redis-server processes; the budget is ``redis.reconnect_s`` and an outage is logged once."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from app.state import keys
from app.state.connection import connect
from app.state.records import OutageRecord
from tests.conftest import free_port

REDIS_SERVER = Path(sys.executable).parent / "redis-server"


class Server:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.dir = tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1",
             # always: a write is in the AOF before its reply, so what a test wrote before a
             # crash is there for certain (everysec may hold a write back up to 2 s on a
             # busy disk); the tests that lose writes cut the file themselves
             "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "always",
             "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        plain = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                plain.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    srv.start()
    yield srv
    srv.stop()


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def restart_after(server: Server, down_s: float) -> None:
    server.kill()
    time.sleep(down_s)
    server.start()


def test_a_blocking_read_rides_a_redis_crash(server):
    client = connect(server.url)
    client.ping()
    t, out = in_thread(lambda: client.blpop(["bell"], timeout=60))
    time.sleep(0.5)  # the BLPOP is blocked in the server
    restart_after(server, 3.0)  # longer than any fixed count of quick retries lasts
    connect(server.url).rpush("bell", "ring")
    t.join(30)
    assert "error" not in out, f"the BLPOP gave up: {out.get('error')!r}"
    assert out.get("value") == ("bell", "ring")


@pytest.mark.parametrize("single", [False, True])
def test_commands_and_transactions_sent_during_an_outage_wait_for_redis(server, single):
    client = connect(server.url, single_connection=single)
    client.set("before", "1")  # in the AOF before the reply (appendfsync always)
    server.kill()

    def transaction():
        pipe = client.pipeline(transaction=True)
        pipe.incr("n")
        pipe.rpush("list", "a")
        return pipe.execute()

    calls = [in_thread(lambda: client.set("during", "1")), in_thread(transaction)]
    time.sleep(3.0)
    server.start()
    for t, out in calls:
        t.join(30)
        assert "error" not in out, f"a command gave up: {out.get('error')!r}"
    assert calls[1][1]["value"] == [1, 1]
    assert client.get("before") == "1" and client.get("during") == "1"


def test_the_budget_comes_from_the_argument_and_then_the_client_gives_up(server):
    client = connect(server.url, reconnect_s=5)
    client.ping()
    server.kill()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    took = time.monotonic() - start
    assert 4.5 <= took < 20, took


def test_the_default_budget_is_redis_reconnect_s(server, monkeypatch):
    import app.state.connection as connection

    monkeypatch.setattr(connection, "reconnect_budget", lambda cfg=None: 5.0)
    client = connect(server.url)
    client.ping()
    server.kill()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert 4.5 <= time.monotonic() - start < 20


def test_the_service_config_sets_the_budget(cfg):
    from app.state.connection import reconnect_budget

    assert reconnect_budget(cfg) == float(cfg.redis.reconnect_s) >= 30


def test_an_outage_is_logged_once_with_its_length_and_recorded(server, caplog):
    from app.state.connection import outage_for

    client = connect(server.url)
    client.ping()
    heard: list[tuple[float, float]] = []
    outage_for(server.url).listeners.append(lambda began, ended: heard.append((began, ended)))
    caplog.set_level(logging.WARNING, logger="app.state.connection")
    server.kill()
    calls = [in_thread(lambda i=i: client.set(f"k{i}", "1")) for i in range(8)]
    time.sleep(2.5)
    server.start()
    for t, out in calls:
        t.join(30)
        assert "error" not in out
    lines = [r.getMessage() for r in caplog.records if r.name == "app.state.connection"]
    assert sum("unreachable" in line for line in lines) == 1, lines
    back = [line for line in lines if "back after" in line]
    assert len(back) == 1, lines
    seconds = float(back[0].split("back after ")[1].split(" s")[0])
    assert 2.0 <= seconds < 15, back
    deadline = time.monotonic() + 10  # recorded by a thread of its own
    while not client.llen(keys.redis_outages()):
        assert time.monotonic() < deadline, "the outage was not recorded in Redis"
        time.sleep(0.1)
    rec = OutageRecord.from_json(client.lindex(keys.redis_outages(), 0))
    assert 2.0 <= rec.seconds < 15 and rec.error
    # the pool's other connections reconnect afterwards: still one outage for the listeners
    for i in range(8):
        client.get(f"k{i}")
    assert len(heard) == 1, heard


def test_a_restart_no_command_waited_through_is_heard(server):
    from app.state.connection import outage_for

    client = connect(server.url)
    client.ping()
    assert outage_for(server.url).server_run_id  # read as the connection connected
    heard: list[tuple[float, float]] = []
    outage_for(server.url).listeners.append(lambda began, ended: heard.append((began, ended)))
    restart_after(server, 0.5)
    assert client.ping()  # the pool reconnects quietly
    deadline = time.monotonic() + 10
    while not heard:
        assert time.monotonic() < deadline, "the restart went unnoticed"
        time.sleep(0.1)
    time.sleep(0.5)
    assert len(heard) == 1


def test_a_quick_restart_is_heard_when_the_process_started_before_its_redis(server):
    """A process that starts before its Redis (honcho starts everything at once) and meets a
    quick restart later still hears it: the server a connection talks to is read as the
    connection connects, not by a look that may have come too early or too late."""
    from app.state.connection import outage_for

    server.kill()
    client = connect(server.url)  # this process's first client of this Redis: it is down
    time.sleep(0.5)
    server.start()
    client.ping()
    heard: list[tuple[float, float]] = []
    outage_for(server.url).listeners.append(lambda began, ended: heard.append((began, ended)))
    restart_after(server, 0.2)
    client.set("after", "1")  # the pool's connection is dead: it reconnects at once
    deadline = time.monotonic() + 10
    while not heard:
        assert time.monotonic() < deadline, "the restart went unnoticed"
        time.sleep(0.1)


def test_an_outage_given_up_on_still_ends_and_later_restarts_are_heard(server):
    """A command that gave up (its budget spent) leaves the outage open; the next command
    that works ends it, so its listeners hear of it and of the restarts after it."""
    from app.state.connection import outage_for

    client = connect(server.url, reconnect_s=1)
    client.ping()
    heard: list[tuple[float, float]] = []
    outage_for(server.url).listeners.append(lambda began, ended: heard.append((began, ended)))
    server.kill()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    server.start()
    assert client.get("k") is None  # a new connection: the command itself meets no failure
    assert len(heard) == 1 and outage_for(server.url).down_since is None
    restart_after(server, 0.2)
    client.set("after", "1")
    assert len(heard) == 2


def test_a_restart_is_heard_once_whatever_order_connections_report_servers_in():
    """Connections to the old server and the new one may connect in any order (one that
    reached the old server just before the crash reports after one that reached the new)."""
    from app.state.connection import Outage

    outage = Outage("redis://127.0.0.1:1/0")
    heard: list[float] = []
    outage.listeners.append(lambda began, ended: heard.append(began))
    for run_id in ["first", "second", "first", "second", None, "second"]:
        outage.connected(run_id)
    assert len(heard) == 1


def test_a_listener_that_raises_fails_neither_the_command_nor_the_other_listeners(caplog):
    from app.state.connection import Outage

    outage = Outage("redis://127.0.0.1:1/0")
    heard: list[float] = []

    def broken(began: float, ended: float) -> None:
        raise RuntimeError("a broken listener")

    outage.listeners += [broken, lambda began, ended: heard.append(began)]
    caplog.set_level(logging.ERROR, logger="app.state.connection")
    outage.connected("first")
    outage.connected("second")  # a restart nobody waited through
    outage.down(time.time(), redis.ConnectionError("refused"), 5.0)
    outage.up()  # an outage a command waited through
    assert len(heard) == 2
    assert sum("a broken listener" in r.getMessage() + str(r.exc_info) for r in caplog.records) == 2


def test_a_connection_closed_while_idle_is_not_an_outage(server, caplog):
    client = connect(server.url)
    client.ping()
    client.client_kill_filter(_type="normal", skipme=False)  # drops this client's connection
    caplog.set_level(logging.WARNING, logger="app.state.connection")
    assert client.ping()
    assert not [r for r in caplog.records if r.name == "app.state.connection"]


def test_health_checks_still_fail_fast(server):
    client = connect(server.url, retry=None, socket_timeout=1, socket_connect_timeout=1)
    client.ping()
    server.kill()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("value", [1, 0, -5, "soon", None])
def test_a_budget_too_short_to_ride_a_restart_is_refused(value):
    from app.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, [f"redis.reconnect_s={'null' if value is None else value}"])
    assert "redis.reconnect_s" in str(info.value) and "must be a number >= 5" in str(info.value)


def test_celery_connections_get_the_same_budget(cfg):
    from app.celery_app import celery_app, retries_covering
    from app.state.connection import ReconnectRetry

    budget = float(cfg.redis.reconnect_s)
    conf = celery_app.conf
    # the result backend's pool: the clients' own retry, with the budget
    retry = celery_app.backend.client.connection_pool.connection_kwargs["retry"]
    assert isinstance(retry, ReconnectRetry) and retry.budget_s == budget
    # publishing: its intervals span the budget
    policy = conf.task_publish_retry_policy
    waits = [min(policy["interval_start"] + policy["interval_step"] * i, policy["interval_max"])
             for i in range(policy["max_retries"])]
    assert sum(waits) >= budget
    backend = conf.result_backend_transport_options["retry_policy"]
    waits = [min(backend["interval_start"] + backend["interval_step"] * i,
                 backend["interval_max"]) for i in range(backend["max_retries"])]
    assert sum(waits) >= budget
    # a worker's consumer: kombu's 2 s + 2 s ... 30 s intervals span the budget
    waits = [min(2.0 + 2.0 * i, 30.0) for i in range(conf.broker_connection_max_retries)]
    assert sum(waits) >= budget
    assert retries_covering(10, 2, 2, 30) == 3  # 2 + 4 + 6

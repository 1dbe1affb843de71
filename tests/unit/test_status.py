"""``carryover status`` names an inference server that answers but gets no call from the
gateway, with why and what ends it; says what each server serves; and lists the last role
exits the supervisors recorded."""

from __future__ import annotations

import http.server
import json

import pytest

from app.config import load_config
from app.config.loader import env_overrides
from app.services import health
from app.services.exits import write_exit
from app.state import keys
from app.state.records import RoleExit
from tests.conftest import serving


def _server(weight_version: str, model: str = "policy", gateway_state: dict | None = None):
    """A stand-in vLLM server (and, with ``gateway_state``, a gateway's /admin/state)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            answers = {"/health": {}, "/version": {"version": "0.0-test"},
                       "/v1/models": {"data": [{"id": model}]},
                       "/weight_info": {"weight_version": weight_version}}
            if gateway_state is not None:
                answers["/admin/state"] = gateway_state
            body = json.dumps(answers.get(self.path, {})).encode()
            self.send_response(200 if self.path in answers else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return serving(Handler)


@pytest.fixture
def status(monkeypatch, capsys):
    """Runs ``carryover status`` with ``overrides``; -> (exit code, stdout)."""
    from app.cli import main

    # status exports its overrides to the environment: put back after the test
    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps(env_overrides()))
    monkeypatch.setattr(health, "check_workers", lambda timeout=2.0: [])

    def run(*overrides: str) -> tuple[int, str]:
        code = main(["status", *overrides])
        return code, capsys.readouterr().out

    return run


def test_status_names_a_server_the_gateway_does_not_route_to_and_why(redis_client, status,
                                                                     monkeypatch):
    for part in ("gateway", "flower"):  # up: the exit status is the unrouted server's alone
        monkeypatch.setattr(health, f"check_{part}",
                            lambda cfg, timeout=2.0, part=part: health.PartStatus(part, True, ""))
    with _server("default") as url:
        redis_client.sadd(keys.upstreams_stale(), url)
        redis_client.hset(keys.policy_published(), mapping={
            "version": "3", "model": "policy", "path": "/dev/shm/carryover/v3"})
        redis_client.set(keys.upstreams_need_weights(),
                         f"{url}: the export of policy version 3 (/dev/shm/carryover/v3) is "
                         "gone (a reboot empties /dev/shm)")
        code, out = status(f"inference.urls=[{url}]", "inference.served_model_name=policy")
    [row] = [line for line in out.splitlines() if line.startswith("inference ")]
    assert row.split()[1] == "UNROUTED", out
    assert "weights=base model" in row  # what it serves meanwhile, labelled
    assert (f"not routed by the gateway: inference {url}: stale, and the trainer worker's "
            "upstream keeper cannot give it the run's weights (the export of policy version 3 "
            "(/dev/shm/carryover/v3) is gone (a reboot empties /dev/shm)): it waits for a run, "
            "whose driver has the trainer serve the run's weights (`carryover train`") in out
    assert "the gateway answers every model call with 503" in out
    assert code == 0  # not a part down: the stack is ready for the run that brings it back


def test_a_routed_server_is_up_and_says_which_policy_version_it_serves(redis_client, status):
    with _server("4") as url:
        _, out = status(f"inference.urls=[{url}]", "inference.served_model_name=policy")
    [row] = [line for line in out.splitlines() if line.startswith("inference ")]
    assert row.split()[1] == "up" and "weights=policy version 4" in row
    # the phrases, not a bare "503": the stand-in server's random port may hold those digits
    assert "not routed" not in out
    assert "the gateway answers every model call with 503" not in out


@pytest.mark.parametrize(("published", "version", "expected"), [
    ({"version": "2", "model": "policy", "path": "/x/v2"}, 2,
     "the trainer worker's upstream keeper loads policy version 2 into it once it answers"),
    ({"version": "2", "model": "policy", "path": "/x/v2"}, 3,
     "policy version 3 was loaded but never verified"),
    ({}, 0, "takes it back with the weights it started with"),
    ({"version": "2", "model": "another", "path": "/x/v2"}, 2,
     "takes it back with the weights it started with"),
])
def test_why_a_stale_server_waits(redis_client, published, version, expected):
    url = "http://127.0.0.1:9"
    redis_client.sadd(keys.upstreams_stale(), url)
    if published:
        redis_client.hset(keys.policy_published(), mapping=published)
    redis_client.set(keys.policy_version(), version)
    cfg = load_config(None, [*env_overrides(), f"inference.urls=[{url}]",
                             "inference.served_model_name=policy"])
    assert expected in health.unroutable(cfg)[url]


def test_a_server_the_running_gateway_skips_is_named(redis_client):
    skipped, routed = "http://127.0.0.1:9", "http://127.0.0.1:10"
    state = {"upstreams": [skipped, routed], "upstreams_healthy": [routed]}
    with _server("default", gateway_state=state) as gateway:
        cfg = load_config(None, [*env_overrides(), f"inference.urls=[{skipped},{routed}]",
                                 f"gateway.url={gateway}"])
        found = health.unroutable(cfg)
    assert list(found) == [skipped]
    assert found[skipped].startswith("the gateway skips it: its health check failed")


def _exit(pid: int, code: int = -9, role: str = "trainer") -> RoleExit:
    return RoleExit(role, "node-1", pid, code, at=1_800_000_000.0 + pid)


def test_status_lists_the_last_role_exits(redis_client, status):
    for pid in range(1, 8):
        write_exit(redis_client, _exit(pid, role="rollout" if pid == 7 else "trainer"))
    write_exit(redis_client, _exit(7, role="rollout"))  # written twice: a lost reply
    _, out = status()
    lines = out.splitlines()
    start = lines.index("role exits recorded (the last 5 of 8 records):")
    listed = lines[start + 1:start + 6]
    assert [line.split("pid ")[1].split()[0] for line in listed] == ["3", "4", "5", "6", "7"]
    assert listed[-1].startswith("  rollout (2027-01-15): SIGKILL (signal 9), pid 7 on node-1")


def test_status_lists_no_exits_when_none_were_recorded(redis_client, status):
    _, out = status()
    assert "role exits recorded" not in out


def test_carryover_up_says_when_a_server_gets_no_call_and_when_it_is_routed_again(
        redis_client, monkeypatch):
    url = "http://127.0.0.1:9"
    cfg = load_config(None, [*env_overrides(), f"inference.urls=[{url}]",
                             "inference.served_model_name=policy"])
    said: list[str] = []
    watch = health.RoutingWatch(cfg, said.append, every_s=0)
    watch()
    assert said == []  # routed: nothing to say
    redis_client.sadd(keys.upstreams_stale(), url)
    redis_client.set(keys.upstreams_need_weights(), f"{url}: the export is gone")
    watch()
    watch()  # said once, not at every look
    assert len(said) == 1 and said[0].startswith(
        f"inference {url} gets no call from the gateway: stale, and the trainer worker's "
        "upstream keeper cannot give it the run's weights (the export is gone): it waits for "
        "a run")
    redis_client.srem(keys.upstreams_stale(), url)
    watch()
    assert said[1:] == [f"inference {url} is routed again"]


def test_carryover_up_watches_the_routing_while_it_runs(monkeypatch):
    from app import cli
    from app.services import supervisor as sv

    looks: list[object] = []

    class Sup:
        def __init__(self, cfg: object) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def start(self, progress: object = None) -> None:
            pass

        def watch_forever(self, each=None, **_: object) -> None:
            looks.append(each)
            raise KeyboardInterrupt

    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps(env_overrides()))
    monkeypatch.setattr(sv, "Supervisor", Sup)
    monkeypatch.setattr(cli, "_interrupt_on_signals", lambda: None)
    assert cli.main(["up"]) == 0
    assert len(looks) == 1 and isinstance(looks[0], health.RoutingWatch)

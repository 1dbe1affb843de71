"""The multi-host security probe's judgement (``bench/multihost_probe.py``), without a stack:
what counts as a refusal, and that a listener it does not know is tried and reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multihost import Cluster
from bench.multihost_probe import Listener, Probe, plan, table


@pytest.mark.parametrize(("kind", "answer", "accept", "refused"), [
    ("http", "401 {}", (401, 403), True),
    ("http", "403 forbidden", (401, 403), True),
    ("http", "200 {}", (401, 403), False),
    ("http", "404 not found", (401, 403), False),
    ("http", "500 boom", (401, 403), False),
    ("http", "404 not found", (401, 403, 404), True),
    ("http", "401 {}", (), False),  # a route only the network may refuse
    ("http", "dropped", (), True),
    ("http", "refused", (401,), True),
    ("http", "error RemoteDisconnected: closed", (401,), False),
    ("redis", "NOAUTH Authentication required.", (), True),
    ("redis", "WRONGPASS invalid username-password pair", (), True),
    ("redis", "PONG", (), False),
    ("tcp", "accepted a connection", (), False),
    ("tcp", "unreachable", (), True),
])
def test_what_counts_as_a_refusal(kind, answer, accept, refused):
    assert Probe("h", 1, "r", "w", kind=kind, accept=accept, answer=answer).refused is refused


def _cluster(tmp_path: Path) -> Cluster:
    c = Cluster(run_dir=tmp_path)
    c.config.write_text("redis: {port: 6390}\ninference: {port: 8100}\n"
                        "gateway: {port: 8200}\n")  # Flower's port: the default's
    return c


def test_a_listener_the_probe_does_not_know_is_tried_and_reported(tmp_path):
    found = {Listener("infer", "10.77.0.3", 8100, "vllm"),
             Listener("trainer", "*", 29500, "celery"),
             Listener("trainer", "127.0.0.1", 5555, "celery"),
             Listener("roll1", "127.0.0.1", 41000, "python")}
    probes, unknown = plan(_cluster(tmp_path), found, rollout="r1")
    assert unknown == [Listener("trainer", "*", 29500, "celery")]
    tried = {(p.host, p.port) for p in probes if p.kind == "tcp"}
    assert tried == {("trainer", 29500), ("roll1", 41000)}
    # every known port is tried whether or not it was found listening
    assert {(p.host, p.port) for p in probes} >= {("redis", 6390), ("infer", 8100),
                                                  ("infer", 8200), ("trainer", 5555)}
    assert any("/rollout/r1/" in p.path for p in probes)


def test_the_table_marks_what_was_not_refused():
    probes = [Probe("infer", 8200, "gateway", "GET /admin/state, no token", answer="200 {}"),
              Probe("infer", 8200, "gateway", "POST /admin/pause, no token",
                    answer='401 {"error": {"code": "invalid_admin_token"}}'),
              Probe("redis", 6390, "redis", "`PING`", kind="redis",
                    answer="NOAUTH Authentication required.")]
    rows = table(probes).splitlines()[2:]
    assert rows == ["| 8200 | gateway (infer) | GET /admin/state, no token | 200 **NOT REFUSED** |",
                    "| 8200 | gateway (infer) | POST /admin/pause, no token | "
                    "401 invalid_admin_token |",
                    "| 6390 | redis (redis) | `PING` | NOAUTH Authentication required. |"]


def test_the_ephemeral_ports_of_a_process_share_a_row():
    probes = [Probe("infer", port, "engine, loopback only (127.0.0.1)", "a TCP connection",
                    kind="tcp", answer="refused") for port in (40001, 40007, 40003, 40005)]
    probes.append(Probe("trainer", 41000, "celery, UNKNOWN on *", "a TCP connection",
                        kind="tcp", answer="accepted a connection"))
    rows = table(probes).splitlines()[2:]
    assert rows == ["| 4 ports, 40001-40007 | engine, loopback only (127.0.0.1) (infer) | "
                    "a TCP connection | connection refused |",
                    "| 41000 | celery, UNKNOWN on * (trainer) | a TCP connection | "
                    "accepted a connection **NOT REFUSED** |"]

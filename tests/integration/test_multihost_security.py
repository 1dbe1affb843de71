"""Every port the multi-host stack opens, tried from a host outside it without credentials
(``bench/multihost_probe.py``): the sockets listening in each host's namespace are found
before, during and after a one-step run, so a port a role opens later is probed too; every
one refuses (401/403, NOAUTH/WRONGPASS, no connection), and a listener beyond loopback that
the probe cannot judge fails the test. The table of what was tried and answered is printed
and kept in the run directory (``probe.md``)."""

from __future__ import annotations

import subprocess
import threading

import pytest

from bench.multihost_probe import (
    FLOWER_HOST,
    NO_CONNECTION,
    Listener,
    all_listeners,
    known_ports,
    probe,
    table,
)
from tests.multihost import (
    SMALL_RUN,
    TEST_TIMEOUT_S,
    multihost,  # noqa: F401 - fixture
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


def test_every_port_refuses_a_host_without_credentials(multihost):  # noqa: F811
    seen: set[Listener] = all_listeners(multihost)
    stop = threading.Event()

    def sample() -> None:  # the ports a run opens only while it runs (the trainer's ranks)
        while not stop.wait(2):
            try:
                seen.update(all_listeners(multihost))
            except (subprocess.SubprocessError, OSError):
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        train(multihost, "trainer.total_steps=1", *SMALL_RUN)  # a real rollout id to try
    finally:
        stop.set()
        sampler.join()
    probes, unknown = probe(multihost, seen)
    text = table(probes) + "\n\nlistening, before, during and after the run:\n" + "\n".join(
        f"- {s.host} {s.addr}:{s.port} {s.process}"
        for s in sorted(seen | all_listeners(multihost), key=lambda s: (s.host, s.port, s.addr)))
    (multihost.run_dir / "probe.md").write_text(text + "\n")
    print(text)

    assert not unknown, ("listening beyond loopback, on no port the probe knows how to "
                         f"judge: {unknown}\n{text}")
    let_in = [f"{p.host}:{p.port} {p.what} (from {p.source}): {p.answer[:200]}"
              for p in probes if not p.refused]
    assert not let_in, "not refused:\n" + "\n".join(let_in)
    # not refused by a broken network: the servers themselves answered where they should
    answered = {(p.role, p.source) for p in probes if p.answer not in NO_CONNECTION}
    assert {("gateway", "outside"), ("redis", "outside"),
            ("inference (vLLM)", "trainer")} <= answered, text
    assert any(p.what.startswith("GET /healthz") and p.answer.startswith("200")
               for p in probes), text
    flower = {port for (_, port), role in known_ports(multihost).items() if role == "flower"}
    assert any(s.host == FLOWER_HOST and s.port in flower for s in all_listeners(multihost)), \
        "Flower was not running: its port was not tried where it listens"

"""A policy version bump lost with the last second of writes is put back once Redis answers
again (app/state/policy.py), against a real redis-server whose AOF loses the bump."""

from __future__ import annotations

import time

from app.state import keys
from app.state.connection import connect, outage_for
from app.state.policy import PublishedVersion, restore_version
from tests.integration.test_lost_writes import Crash, server  # noqa: F401 - fixture


def test_the_version_is_raised_never_lowered(server):  # noqa: F811
    client = connect(server.url)
    client.set(keys.policy_version(), 3)
    assert restore_version(client, 5) == 3
    assert client.get(keys.policy_version()) == "5"
    assert restore_version(client, 4) is None  # another trainer went further: left alone
    assert client.get(keys.policy_version()) == "5"


def test_a_lost_bump_is_put_back_when_redis_is_back(server):  # noqa: F811
    client = connect(server.url)
    client.set(keys.policy_version(), 6)
    published = PublishedVersion()
    outage_for(server.url).listeners.append(
        lambda began, ended: published.check_soon(client))
    crash = Crash(server, client)
    crash.mark()
    client.set(keys.policy_version(), 7)  # the bump, acknowledged
    published.published(7)
    crash.lose()  # ... and lost
    # the next command finds Redis back (after retrying): the outage's end puts 7 back
    deadline = time.monotonic() + 15
    while client.get(keys.policy_version()) != "7":
        assert time.monotonic() < deadline, client.get(keys.policy_version())
        time.sleep(0.1)


def test_current_version_reads_what_redis_holds(server):  # noqa: F811
    from app.state.policy import current_version

    client = connect(server.url)
    client.delete(keys.policy_version())
    assert current_version(client) == 0  # before the first weight load
    client.set(keys.policy_version(), 12)
    assert current_version(client) == 12


def test_no_module_reads_the_policy_version_raw():
    """One read of the version (``current_version``): a raw GET elsewhere is a second
    definition of 'no version yet'."""
    import re

    from tests.conftest import REPO

    raw = re.compile(r"\.get\(keys\.policy_version\(\)\)")
    found = [f"{p.relative_to(REPO)}:{i}" for folder in ("app", "workers", "gateway")
             for p in (REPO / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if raw.search(line) and p.name != "policy.py"]
    assert found == []

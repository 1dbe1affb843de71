"""Redis clients from URLs (app/state/connection.py), against real redis-server processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.state.connection import connect, redact

REDIS_SERVER = Path(sys.executable).parent / "redis-server"


def test_a_unix_socket_url_works(tmp_path, monkeypatch):
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([str(REDIS_SERVER), "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--dir", str(tmp_path), "--requirepass", "p@ss"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        url = f"unix://{sock}?db=3&password=p%40ss"
        for single in (False, True):
            client = connect(url, single_connection=single)
            assert client.ping()
            client.set("k", "v")
            assert client.get("k") == "v"
        # Celery's broker and result backend reach it too (they spell the URL their way)
        from app.celery_app import make_celery

        monkeypatch.setenv("REDIS_URL", url)
        app = make_celery()
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            conn.default_channel.client.set("from-the-broker", 1)
        app.backend.set("r", "done")
        assert app.backend.get("r") == b"done"
        # all three on the same database (the reaper reads the broker's keys this way)
        assert client.get("from-the-broker") == "1" and client.get("r") == "done"
        assert app.conf.carryover_redis_url == url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url, shown", [
    ("redis://:secret@host:6379/0", "redis://***@host:6379/0"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///tmp/r.sock?db=1&password=secret", "unix:///tmp/r.sock?db=1&password=***"),
    ("unix:///tmp/r.sock?password=secret", "unix:///tmp/r.sock?password=***"),
])
def test_passwords_are_redacted(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize("url, expected", [
    ("redis://host:6379/0", "redis://:s%40cret@host:6379/0"),
    ("rediss://host:6379/2", "rediss://:s%40cret@host:6379/2"),
    ("redis://:own@host:6379/0", "redis://:own@host:6379/0"),   # the URL's own wins
    ("redis://user@host:6379/0", "redis://user:s%40cret@host:6379/0"),  # an ACL user
    ("unix:///tmp/r.sock", "unix:///tmp/r.sock?password=s%40cret"),
    ("unix:///tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1&password=s%40cret"),
])
def test_redis_password_goes_with_a_configured_url(url, expected, monkeypatch):
    """redis.password applies to redis.url as to the embedded server; $REDIS_URL is used
    as it is."""
    from app.config import load_config
    from app.state.connection import resolve_redis_url

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    cfg = load_config(None, [f"redis.url={url}", "redis.password=s@cret"])
    assert resolve_redis_url(cfg) == expected
    monkeypatch.setenv("REDIS_URL", "redis://other:1/0")
    assert resolve_redis_url(cfg) == "redis://other:1/0"

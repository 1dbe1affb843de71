"""Redis clients from URLs (app/state/connection.py), against real redis-server processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.state.connection import connect, redact

REDIS_SERVER = Path(sys.executable).parent / "redis-server"


def test_a_unix_socket_url_works(tmp_path):
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([str(REDIS_SERVER), "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        for single in (False, True):
            client = connect(f"unix://{sock}", single_connection=single)
            assert client.ping()
            client.set("k", "v")
            assert client.get("k") == "v"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url, shown", [
    ("redis://:secret@host:6379/0", "redis://***@host:6379/0"),
    ("redis://host:6379/0", "redis://host:6379/0"),
])
def test_passwords_are_redacted(url, shown):
    assert redact(url) == shown

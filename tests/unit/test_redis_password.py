"""The embedded Redis's password never appears on a command line: any local process (another
user's `ps`, another host of the multi-host harness sharing the PID namespace) could read it
from /proc/<pid>/cmdline. redis-server reads it from a config file of the owner's alone in its
data directory, rewritten on each start."""

from __future__ import annotations

import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis

from app.config import load_config
from app.services.commands import command_for
from tests.conftest import REPO, free_port

PASSWORD = "s3cret \"quoted\" \\ back'slash #not-a-comment\tand\nnew line, \u00e9 and:odd@chars"


@pytest.fixture(autouse=True)
def _no_password_in_the_environment(monkeypatch):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, [f"redis.dir={tmp_path / 'redis'}", *overrides])


def _conf_files(argv: list[str]) -> list[Path]:
    return [Path(a) for a in argv[1:] if a.endswith(".conf")]


def test_the_password_is_in_a_private_file_not_on_the_command_line(tmp_path, monkeypatch):
    cmd = command_for(_cfg(tmp_path, "redis.password=first-password"), "redis")
    assert not any("first-password" in a for a in cmd.argv)
    assert not any("first-password" in v for v in cmd.env.values())
    assert "--requirepass" not in cmd.argv
    [conf] = _conf_files(cmd.argv)
    assert conf.parent == (tmp_path / "redis").resolve()
    assert cmd.argv[1] == str(conf)  # redis-server takes its config file first
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert "first-password" in conf.read_text()
    # a later start with another password (here from the environment) rewrites it
    monkeypatch.setenv("REDIS_PASSWORD", "second-password")
    conf.chmod(0o644)
    cmd = command_for(_cfg(tmp_path), "redis")
    assert _conf_files(cmd.argv) == [conf]
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert "second-password" in conf.read_text() and "first-password" not in conf.read_text()
    # and a start without one leaves no old password behind
    monkeypatch.delenv("REDIS_PASSWORD")
    cmd = command_for(_cfg(tmp_path), "redis")
    assert not conf.exists() and not _conf_files(cmd.argv)


def test_the_real_server_takes_the_password_without_showing_it(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)  # as is (an override is parsed as YAML)
    cmd = command_for(_cfg(tmp_path, f"redis.port={port}"), "redis")
    # Once up, redis-server writes its process title over its arguments; until then (a
    # window that a loaded machine stretches) /proc/<pid>/cmdline shows them as exec'd. With
    # the title left alone, what it shows is what any local process could read then.
    server = subprocess.Popen([*cmd.argv, "--set-proc-title", "no"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password=PASSWORD, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.AuthenticationError:
                raise  # a ConnectionError too: the server is up and refused the password
            except redis.ConnectionError:
                assert server.poll() is None, "redis-server exited"
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="not-it", socket_timeout=5).ping()
        # the other options still come from the command line
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in cmdline
        assert b"s3cret" not in cmdline
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_inference_key_is_in_the_environment_not_on_the_command_line(tmp_path):
    cmd = command_for(_cfg(tmp_path, "inference.api_key=the-servers-key"), "inference")
    assert not any("the-servers-key" in a for a in cmd.argv)
    assert "--api-key" not in cmd.argv
    assert cmd.env["VLLM_API_KEY"] == "the-servers-key"


def test_the_gateway_command_line_holds_no_secret(tmp_path):
    cmd = command_for(_cfg(tmp_path, "gateway.admin_token=the-admin-token",
                           "inference.api_key=the-servers-key"), "gateway")
    assert not any("the-admin-token" in a or "the-servers-key" in a for a in cmd.argv)

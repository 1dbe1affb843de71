"""vLLM's IPC sockets: a private directory, and a sweep that removes only the dead ones."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from app.services.rpc_sockets import rpc_dir, sweep


def _socket(path: Path, listen: bool, age_s: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listen:
        sock.listen()
    else:
        sock.close()  # the file stays, as a stopped server leaves it
    then = time.time() - age_s
    os.utime(path, (then, then))
    return sock if listen else None


def test_sweep_removes_old_dead_sockets_only(tmp_path):
    live = _socket(tmp_path / "live", listen=True, age_s=3600)
    _socket(tmp_path / "dead", listen=False, age_s=3600)
    _socket(tmp_path / "just-bound", listen=False, age_s=0)  # a server still starting
    (tmp_path / "file").write_text("not a socket")
    os.utime(tmp_path / "file", (0, 0))
    try:
        assert sweep(tmp_path) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "just-bound", "live"]
        assert sweep(tmp_path) == 0
    finally:
        live.close()
    assert sweep(tmp_path, min_age_s=0) == 2  # both now refuse a connection


def test_the_directory_is_private_and_short():
    path = rpc_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()
    # vLLM names a socket <dir>/<uuid4>; a Unix socket path holds 107 bytes at most
    assert len(str(path)) + 37 <= 107


def test_the_inference_command_points_vllm_at_it():
    from app.config import load_config
    from app.services.commands import inference_command

    env = inference_command(load_config(None, ["inference.device=cpu"])).env
    assert env["VLLM_RPC_BASE_PATH"] == str(rpc_dir())


@pytest.mark.timeout(20)
def test_a_server_that_stopped_accepting_is_kept_and_the_sweep_does_not_block(tmp_path):
    """A stopped server (SIGSTOP, a debugger) accepts nothing: its listen queue fills with
    each sweep's connects, and a blocking connect would then wait for good."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "stuck"))
    server.listen(0)
    os.utime(tmp_path / "stuck", (0, 0))
    try:
        for _ in range(5):
            assert sweep(tmp_path) == 0
        assert (tmp_path / "stuck").exists()
    finally:
        server.close()


def test_a_long_temporary_directory_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = rpc_dir()
    assert path.parent == Path("/tmp") and len(str(path)) + 37 <= 107

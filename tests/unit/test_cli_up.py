"""``carryover up`` that cannot start its stack says why in one line, without a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.stack import stack_overrides
from tests.conftest import REPO


def test_a_taken_port_is_one_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(stack_overrides(
            tmp_path, f"redis.port={port}", f"logging.dir={tmp_path / 'runs'}"))}
        env.pop("REDIS_URL", None)
        out = subprocess.run([str(Path(sys.executable).parent / "carryover"), "up"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"error: redis: port {port} on 127.0.0.1 is already in use" in out.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_closed_terminal_stops_the_stack_in_order_too(signum):
    """``carryover up`` stops its roles on Ctrl-C and SIGTERM, and on SIGHUP (a closed
    terminal or a dropped ssh session): its roles run in sessions of their own, so they
    would outlive it and hold their ports (and a GPU) for the next ``up``."""
    from app.cli import _interrupt_on_signals

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):  # what the test sees where up leaves a signal alone
        raise Unhandled(signal.Signals(signum).name)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for s in saved:
            signal.signal(s, unhandled)
        _interrupt_on_signals()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
            time.sleep(1)  # the handler runs in the main thread before this returns
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_stack_started_under_nohup_keeps_sighup_ignored():
    """``nohup carryover up &``: the terminal's SIGHUP must not stop the stack."""
    from app.cli import _interrupt_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _interrupt_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens
        time.sleep(0.2)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)

"""``carryover up`` that cannot start its stack says why in one line, without a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

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

"""``carryover up`` keeps the stack running when a role dies: the rollout worker SIGKILLed in
the middle of a run is started again, the groups worker's reaper requeues what it held, and
the run finishes every step with full groups. ``carryover status`` counts the restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.config import load_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
from app.state.records import SiblingResult
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def test_rollout_worker_killed_under_carryover_up(tmp_path):
    inf, gw = free_port(), free_port()
    overrides = [
        f"redis.port={free_port()}", f"redis.dir={tmp_path / 'redis'}",
        f"inference.port={inf}", f"inference.urls=[http://127.0.0.1:{inf}]",
        f"gateway.port={gw}", f"gateway.url=http://127.0.0.1:{gw}",
        f"services.flower_port={free_port()}", "services.worker_heartbeat_s=3",
        "services.rollout_concurrency=16", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "agentlightning.async_rollout.async_train_batch_size=8",
        "trainer.total_steps=6", f"logging.dir={tmp_path / 'runs'}",
        "logging.wandb_mode=disabled", f"trainer.weights_dir={tmp_path / 'w'}",
        f"trainer.checkpoint_dir={tmp_path / 'c'}"]
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides),
           "CARRYOVER_CONFIG": str(REPO / "config" / "demo.yaml")}
    cfg = load_config(str(REPO / "config" / "demo.yaml"), overrides)
    up_log = open(tmp_path / "up.log", "w")  # noqa: SIM115
    up = subprocess.Popen([str(BIN / "carryover"), "up"], cwd=REPO, env=env, stdout=up_log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "all parts up" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(1)
        client = connect(resolve_redis_url(cfg))
        train = subprocess.Popen([str(BIN / "carryover"), "train"], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_key = None
        deadline = time.monotonic() + 240
        while run_key is None or client.llen(run_key) < 2:  # after step 1
            assert train.poll() is None and time.monotonic() < deadline
            runs = [k for k in client.scan_iter(keys.run("*") + ":metrics")]
            run_key = runs[0] if runs else None
            time.sleep(0.2)
        worker = next(p for p in psutil.Process(up.pid).children()
                      if "-Q" in p.cmdline() and "rollout" in p.cmdline())
        os.killpg(worker.pid, signal.SIGKILL)
        out, _ = train.communicate(timeout=400)
        assert train.returncode == 0, out[-3000:]
        assert up.poll() is None  # the stack is still up
        run_id = run_key.split(":")[-2]
        for step in range(6):
            groups = client.lrange(keys.run_step_groups(run_id, step), 0, -1)
            assert len(groups) == 4
            for gid in groups:
                results = [SiblingResult.from_json(v)
                           for v in client.hgetall(keys.group_results(gid)).values()]
                assert len(results) == 2 and all(r.status == "ok" for r in results), gid
        status = subprocess.run([str(BIN / "carryover"), "status"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=60)
        assert "rollout x1" in status.stdout, status.stdout
        assert "starting it again" in (tmp_path / "up.log").read_text()
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        up_log.close()

"""The inference server restarted mid-run (SIGKILL, then started again with its initial
weights): the gateway answers retryable errors meanwhile, the trainer puts the current
weights back into the new server before agents reach it, and the run finishes."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import requests

from app.state import keys
from tests.faults.test_worker_kills import assert_trained_once_and_whole, sigkill, wait_for
from tests.integration.test_collector import make_cfg, stack  # noqa: F401 - fixture
from workers.trainer import weights

pytestmark = pytest.mark.slow


def test_inference_server_restart(stack, tmp_path, celery_workers, cfg,  # noqa: F811
                                  new_rollout):
    samples = [{"sleep": 0.2} for _ in range(24)]
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=4")
    seen: dict = {}
    restarted = threading.Event()

    def restart() -> None:
        t = time.monotonic()
        celery_workers.start(["inference"])
        seen["restart_s"] = time.monotonic() - t
        restarted.set()

    def on_step(step: int, metrics: dict) -> None:
        if step != 0 or seen:
            return
        sigkill(celery_workers, "inference")
        # An agent's call now gets a retryable answer, not a hang or a 500.
        rid, token, base = new_rollout()
        resp = requests.post(base + "/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {token}"})
        seen["status"], seen["retry_after"] = resp.status_code, resp.headers.get("Retry-After")
        seen["body"] = resp.json()
        threading.Thread(target=restart, daemon=True).start()

    from app.driver.loop import train

    result = train(run_cfg, on_step=on_step)
    assert restarted.wait(300), "vLLM did not come back"
    assert result["steps"] == 4
    assert seen["status"] == 503 and float(seen["retry_after"]) > 0, seen
    assert seen["body"]["error"]["code"] in ("upstream_unavailable", "paused"), seen
    run_id = result["run_id"]
    assert_trained_once_and_whole(stack, run_id, 4, 2, 2)
    # The restarted server is back in rotation and holds the last published weights.
    wait_for(lambda: not stack.smembers(keys.upstreams_stale()), 30, "the server to be usable")
    published = stack.hgetall(keys.policy_published())
    rows = [json.loads(r) for r in stack.lrange(keys.run_metrics(run_id), 0, -1)]
    assert int(published["version"]) == rows[-1]["policy/version"]
    url = cfg.inference.urls[0]
    weights.verify_sync(url, cfg.inference.served_model_name, json.loads(published["probe"]),
                        None, float(cfg.trainer.probe_tolerance),
                        json.loads(published["probe_ids"]))
    log = celery_workers.log_path("trainer").read_text(errors="replace")
    assert "is unreachable" in log or "is down" in log


def test_a_reboot_of_the_trainers_host_between_steps(stack, tmp_path, celery_workers):  # noqa: F811
    """The host of the trainer worker and the inference server reboots while the driver
    collects: both restart, the server with its initial weights, and the published export
    is gone (a reboot empties /dev/shm). The keeper cannot restore the server, and with no
    server no group finishes (each carried rollout makes a call once its gate opens), so no
    update would come to reload it: the driver asks the trainer worker for the run's
    weights, which loads the last checkpoint (none here, so the two updates made are lost,
    and reported) and serves them; the run finishes."""
    import shutil

    samples = [{}, {}, {"gate": "s1"}, {"gate": "s1"}] + [
        {"gate": "reboot", "call_after_gate": True} for _ in range(12)]
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=4", "trainer.save_freq=10")
    seen: dict = {}

    def on_step(step: int, metrics: dict) -> None:
        if step == 0:
            stack.set("test:gate:s1", 1)
        if step != 1:
            return
        # step 2's groups are dispatched and wait at the gate: none can finish yet
        published = stack.hgetall(keys.policy_published())
        sigkill(celery_workers, "trainer")
        sigkill(celery_workers, "inference")
        shutil.rmtree(published["path"], ignore_errors=True)
        seen["version"] = int(published["version"])
        celery_workers.start(["inference", "trainer"])
        stack.set("test:gate:reboot", 1)

    from app.driver.loop import train

    out: dict = {}

    def target() -> None:
        try:
            out["result"] = train(run_cfg, on_step=on_step)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(300)
    log = celery_workers.log_path("trainer").read_text(errors="replace")
    assert not thread.is_alive(), "the run stalled after the reboot\n" + log[-3000:]
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert result["steps"] == 4
    run_id = result["run_id"]
    assert_trained_once_and_whole(stack, run_id, 4, 2, 2)
    rows = [json.loads(r) for r in stack.lrange(keys.run_metrics(run_id), 0, -1)]
    # the restore came from the driver's request, before step 2's groups could finish
    assert re.search(r"tasks\.restore_servers\[[^]]+\] succeeded", log)
    assert "is gone" in log
    assert rows[2]["trainer/rolled_back_updates"] == 2
    assert rows[2]["trainer/restored_from_step"] is None
    assert rows[2]["trainer/restored_policy_version"] > seen["version"]
    assert "trainer/rolled_back_updates" not in rows[3]
    versions = [r["policy/version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 4
    assert not stack.exists(keys.upstreams_need_weights())   # cleared by the verified load

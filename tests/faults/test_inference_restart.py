"""The inference server restarted mid-run (SIGKILL, then started again with its initial
weights): the gateway answers retryable errors meanwhile, the trainer puts the current
weights back into the new server before agents reach it, and the run finishes."""

from __future__ import annotations

import json
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

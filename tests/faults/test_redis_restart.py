"""Redis restarted (AOF on) in the middle of collection: the driver, the Celery workers and
the gateway reconnect, the run finishes, and no group is lost or trained twice."""

from __future__ import annotations

import time

import pytest

from app.services.commands import command_for
from app.state import keys
from app.state.records import SiblingResult
from tests.integration.test_collector import make_cfg, stack  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def restart_redis(supervisor, cfg, client) -> None:
    proc = supervisor.procs["redis"]
    proc.terminate()  # SIGTERM: Redis writes its AOF and exits, as in a planned restart
    proc.wait(30)
    time.sleep(1.0)  # everyone sees connection errors for a while
    supervisor._spawn(command_for(cfg, "redis"))
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return
        except Exception:  # noqa: BLE001 - not up yet
            assert time.monotonic() < deadline, "Redis did not come back"
            time.sleep(0.2)


def test_run_survives_a_redis_restart(stack, tmp_path, celery_workers, cfg):  # noqa: F811
    samples = [{"sleep": 0.3} for _ in range(12)]
    run_cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=4")
    restarted = []

    def on_step(step: int, metrics: dict) -> None:
        if step == 1 and not restarted:
            restart_redis(celery_workers, cfg, stack)
            restarted.append(time.time())

    from app.driver.loop import train

    result = train(run_cfg, on_step=on_step)
    assert restarted and result["steps"] == 4
    run_id = result["run_id"]
    trained = [g for s in range(4) for g in stack.lrange(keys.run_step_groups(run_id, s), 0, -1)]
    assert len(trained) == 8 and len(set(trained)) == 8  # nothing trained twice
    for gid in trained:  # every trained group was complete
        results = [SiblingResult.from_json(v)
                   for v in stack.hgetall(keys.group_results(gid)).values()]
        assert len(results) == 2 and all(r.status == "ok" for r in results)
    # groups dispatched before the restart are still known (AOF), none vanished
    seqs = stack.hget(keys.run(run_id), "next_seq")
    if seqs is not None:
        for i in range(int(seqs)):
            assert stack.exists(keys.group(f"{run_id}-g{i}"))

"""A step's stored result lost with the last second of writes (a Redis crash): the step sent
again is answered by the trainer worker that trained it, not trained a second time."""

from __future__ import annotations

import json

import pytest

from app.state import keys
from tests.integration.test_collector import make_cfg, stack  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def test_a_step_whose_result_was_lost_is_not_trained_again(stack, tmp_path):  # noqa: F811
    from app.celery_app import celery_app
    from app.driver.loop import train

    run_cfg = make_cfg(tmp_path, [{"sleep": 0} for _ in range(8)], "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=2")
    result = train(run_cfg)
    run_id = result["run_id"]
    version = stack.get(keys.policy_version())
    stored = json.loads(stack.get(keys.run_step_result(run_id, 1)))
    stack.delete(keys.run_step_result(run_id, 1))  # the write the crash lost
    again = celery_app.send_task("workers.trainer.tasks.train_step", args=[run_id, 1])
    metrics = again.get(timeout=120)
    assert {k: metrics[k] for k in stored} == stored  # the step's own answer
    assert stack.get(keys.policy_version()) == version  # no second update
    assert json.loads(stack.get(keys.run_step_result(run_id, 1))) == metrics  # stored again


def test_a_driver_killed_right_after_recording_a_step_keeps_its_metrics(
        stack, tmp_path, monkeypatch):  # noqa: F811
    """The driver dies the moment a step is recorded as done: the resumed run starts past
    it, and that step's metrics are still in Redis and in metrics.jsonl, once."""
    from app.driver.collector import Collector
    from app.driver.loop import train

    class Killed(BaseException):
        pass

    run_cfg = make_cfg(tmp_path, [{"sleep": 0} for _ in range(8)], "data.train_batch_size=2",
                       "agentlightning.async_rollout.async_train_batch_size=4",
                       "trainer.total_steps=2")
    recorded = Collector.set_step

    def then_die(self, step, *args, **kwargs):
        recorded(self, step, *args, **kwargs)
        if step == 1:
            raise Killed

    monkeypatch.setattr(Collector, "set_step", then_die)
    run_id = f"killed-after-step-{tmp_path.name[-8:]}"
    with pytest.raises(Killed):
        train(run_cfg, run_id=run_id)
    monkeypatch.setattr(Collector, "set_step", recorded)
    assert stack.hget(keys.run(run_id), "step") == "1"
    # a group dropped while no driver ran (its chord callback counts it)
    stack.hincrby(keys.run(run_id), "n_dropped", 1)
    result = train(run_cfg, resume=run_id)
    assert result["steps"] == 2
    kept = [json.loads(e) for e in stack.lrange(keys.run_metrics(run_id), 0, -1)]
    assert [e["step"] for e in kept if "timing/step_seconds" in e] == [0, 1], kept
    # every drop is in some step's metrics
    assert sum(e.get("training/async/n_dropped_groups", 0) for e in kept) \
        == int(stack.hget(keys.run(run_id), "n_dropped"))
    lines = [json.loads(x) for x in open(result["jsonl"])]
    assert [e["step"] for e in lines if "timing/step_seconds" in e] == [0, 1], lines

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

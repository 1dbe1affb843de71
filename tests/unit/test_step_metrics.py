"""A step's metrics entry (``app.driver.metrics.step_metrics``): the names of
``docs/metrics.md``, in the order the JSONL line shows them, from what the step did."""

from __future__ import annotations

import pytest

from app.driver.collector import Selection
from app.driver.metrics import step_metrics

COUNTED = {"dropped": 4, "cancelled": 1, "dispatched": 20, "filtered": 2, "quarantined": 0,
           "requeued": 3}
NOW = {"dropped": 5, "cancelled": 1, "dispatched": 26, "filtered": 4, "quarantined": 1,
       "requeued": 4}


def entry(selection: Selection | None) -> dict:
    return step_metrics({"reward/mean": 0.5, "training/async/proxy_drain_seconds": 0.25},
                        selection, 3, 4, NOW, COUNTED, waited=2.0, overdue=0.5,
                        update_s=7.0, step_s=9.5, redis_used_memory=1024)


def test_a_step_with_its_selection_reports_the_carry_over_and_what_the_counters_moved_by():
    selection = Selection(step=5, group_ids=["g1", "g2", "g3"], prev_carry_over_rollouts=6,
                          new_carry_over_rollouts=7, carry_over_finished_rollouts=2,
                          complete_unselected_rollouts=4, carry_over_age_max=2,
                          consumed_ages=[0, 1, 2], wait_seconds=2.0)
    assert list(entry(selection).items()) == [
        ("reward/mean", 0.5),
        ("training/async/proxy_drain_seconds", 0.25),
        ("training/async/n_prev_carry_over_rollouts", 6),
        ("training/async/n_completed_rollouts", 12),  # the groups trained x rollout.n
        ("training/async/n_new_carry_over_rollouts", 7),
        ("training/async/new_carry_over_age_max_steps", 2),
        ("training/async/n_carry_over_finished_rollouts", 2),
        ("training/async/n_complete_unselected_rollouts", 4),
        ("training/async/consumed_age_mean_steps", 1.0),
        ("training/async/consumed_age_max_steps", 2),
        ("training/async/filtered_group_share", pytest.approx(2 / 5)),  # 2 filtered, 3 trained
        ("training/async/n_dropped_groups", 1),
        ("training/async/n_requeued_groups", 1),
        ("training/async/n_cancelled_groups", 0),
        ("training/async/n_filtered_groups", 2),
        ("training/async/n_quarantined_prompts", 1),
        ("timing/wait_for_data_seconds", 2.0),
        ("timing/wait_for_overdue_seconds", 0.5),
        ("timing/update_seconds", 7.0),
        ("timing/step_seconds", 9.5),
        ("redis/used_memory_bytes", 1024),
    ]


def test_a_step_whose_selection_is_not_known_reports_no_carry_over_and_no_overdue_wait():
    metrics = entry(None)
    assert not any("carry_over" in name or "consumed_age" in name for name in metrics)
    assert "training/async/filtered_group_share" not in metrics
    assert metrics["timing/wait_for_overdue_seconds"] == 0.0
    assert metrics["training/async/n_dropped_groups"] == 1

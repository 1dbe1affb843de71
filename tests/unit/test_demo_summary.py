"""The demo's summary of a run: the figures the README's table is read from."""

from __future__ import annotations

import pytest

from app.demo import summarize
from app.driver.metrics import CARRY


def _row(step: int, reward: float | None, step_s: float, wait_s: float, carried: int) -> dict:
    return {"step": step, "reward/mean": reward, "timing/step_seconds": step_s,
            "timing/wait_for_data_seconds": wait_s, CARRY + "n_new_carry_over_rollouts": carried,
            CARRY + "proxy_drain_seconds": 0.5}


def test_a_run_is_summarized_from_its_rows_and_evaluations():
    rows = [_row(i, r, 6.0, 1.5, i % 2) for i, r in
            enumerate([0.0, 0.2, None, 0.4, 0.5, 0.6, 0.7, 0.8])]
    evals = [{"step": 0, "val/success_rate": 0.25, "val/reward_mean": 0.2},
             {"step": 8, "val/success_rate": 0.75, "val/reward_mean": 0.7}]
    out = summarize({"rows": rows, "evals": evals})
    assert out["steps"] == 8
    assert out["steps_per_minute"] == pytest.approx(10.0)   # 8 steps in 48 s
    assert out["reward_first_2"] == pytest.approx(0.1)
    assert out["reward_last_5"] == pytest.approx(0.6)       # 0.4 .. 0.8
    assert out["reward_gain"] == pytest.approx(0.5)
    assert out["trainer_idle_fraction"] == pytest.approx(0.25)
    assert out["mean_step_seconds"] == pytest.approx(6.0)
    assert out["carried_over_rollouts_total"] == 4
    assert out["mean_drain_seconds"] == pytest.approx(0.5)
    assert (out["val_success_first"], out["val_success_last"]) == (0.25, 0.75)
    assert out["val_success_gain"] == pytest.approx(0.5)
    assert out["val_reward_last"] == 0.7


def test_a_metric_that_is_not_a_number_is_named_not_summed():
    rows = [_row(0, 0.1, 6.0, 1.0, 0), {**_row(1, 0.2, 6.0, 1.0, 0),
                                        "timing/step_seconds": "6.0"}]
    with pytest.raises(TypeError, match="a metric's value is a str"):
        summarize({"rows": rows, "evals": []})

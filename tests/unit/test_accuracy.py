"""Time to accuracy from a run's metrics: an evaluation is timed at the update it measured,
a run that never reaches the threshold is the slowest, and the default threshold comes from
the synchronous runs."""

from __future__ import annotations

from app.accuracy import compare, curve, minutes_to, spread, table

CARRY = "training/async/"


def run(step_seconds: list[float], evals: dict[int, float], carried: int = 0) -> list[dict]:
    rows: list[dict] = [{"step": i, "timing/step_seconds": s, CARRY + "n_completed_rollouts": 32,
                         CARRY + "n_new_carry_over_rollouts": carried,
                         CARRY + "consumed_age_mean_steps": 1.0 if carried else 0.0,
                         CARRY + "consumed_age_max_steps": 2.0 if carried else 0.0,
                         CARRY + "new_carry_over_age_max_steps": 1.0 if carried else 0.0}
                        for i, s in enumerate(step_seconds)]
    # evaluations are logged after later steps: only sent_at_step says which update they measured
    rows += [{"step": min(at + 1, len(step_seconds) - 1), "val/sent_at_step": at,
              "val/success_rate": v} for at, v in evals.items()]
    return rows


def test_an_evaluation_is_timed_at_the_update_it_measured():
    rows = run([60, 120, 60], {0: 0.2, 2: 0.5, 3: 0.9})
    steps = [r for r in rows if "val/success_rate" not in r]
    evals = [r for r in rows if "val/success_rate" in r]
    assert curve(steps, evals) == [(0.0, 0.2), (3.0, 0.5), (4.0, 0.9)]
    assert minutes_to(curve(steps, evals), 0.5) == 3.0
    assert minutes_to(curve(steps, evals), 0.95) is None
    # the evaluation before training is where the run starts, not where it arrives
    assert minutes_to(curve(steps, evals), 0.1) == 3.0


def test_a_run_that_never_gets_there_is_the_slowest():
    assert spread([2.0, None, 4.0])["median"] == 4.0
    assert spread([2.0, None, None])["median"] is None
    assert spread([2.0, None, None])["min"] == 2.0


def test_the_threshold_is_the_synchronous_final_minus_five_points():
    fast = run([60] * 4, {0: 0.2, 2: 0.85, 4: 0.9}, carried=8)
    slow = run([240] * 4, {0: 0.2, 2: 0.6, 4: 0.9})
    result = compare({"async": [fast, fast], "sync": [slow, slow]})
    assert result["threshold"] == 0.85
    assert result["modes"]["async"]["minutes_to_threshold"]["median"] == 2.0
    assert result["modes"]["sync"]["minutes_to_threshold"]["median"] == 16.0
    assert result["speedup_to_threshold"] == 8.0
    a = result["modes"]["async"]
    assert a["trained_rollouts_per_minute"]["median"] == 32.0
    assert a["carried_over_rollouts_total"]["median"] == 32
    assert a["sample_age_max_steps"]["median"] == 2.0
    text = table(result)
    assert "8.00x sooner" in text and "minutes_to_threshold" in text


def test_a_synchronous_run_that_did_not_learn_sets_no_threshold_its_start_meets():
    """Its final success minus 0.05 is below where every run started: the threshold is set
    above the start, and a run that never gets there is reported as never."""
    learned = run([30] * 4, {0: 0.27, 3: 0.77, 4: 0.83}, carried=8)
    flat = run([100] * 4, {0: 0.30, 3: 0.23, 4: 0.30})
    result = compare({"async": [learned], "sync": [flat]})
    assert result["threshold"] == 0.4  # 0.30 + 0.1, not 0.25
    assert result["modes"]["async"]["minutes_to_threshold"]["median"] == 1.5
    assert result["modes"]["sync"]["minutes_to_threshold"]["median"] is None
    assert "speedup_to_threshold" not in result
    assert "never" in table(result)


def test_without_an_evaluation_before_training_the_first_one_counts():
    rows = run([60, 60, 60, 60, 60, 60], {3: 0.9, 6: 0.95})
    steps = [r for r in rows if "val/success_rate" not in r]
    evals = [r for r in rows if "val/success_rate" in r]
    assert minutes_to(curve(steps, evals), 0.85) == 3.0
    result = compare({"sync": [rows]})
    assert result["threshold"] == 0.9  # the final 0.95 - 0.05; no start to stay above

"""The async benchmark's ideal: exact for its workloads, and a mode faster than it is an error
(no schedule beats it)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.agents import duration
from bench.async_vs_sync import above_ideal, expected_duration, warmup_end


def test_a_mode_faster_than_the_ideal_is_an_error():
    ok = {"label": "w", "mode": "async x2", "trained_rollouts_per_s": 3.0,
          "ideal_rollouts_per_s": 4.0}
    fast = {**ok, "mode": "async x3", "trained_rollouts_per_s": 4.4}
    assert above_ideal([ok]) is None
    assert "above the ideal" in above_ideal([ok, fast]) and "async x3 110%" in above_ideal([fast])


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
def test_the_expected_duration_is_the_agents_mean(sigma):
    """E[min(X, 60 s)] of the sleeps the benchmark's agents draw, against a sample of them."""
    draws = [min(duration("lognormal", 2.0, sigma, 0, seq, i), 60.0)
             for seq in range(4000) for i in range(4)]
    mean, sem = statistics.fmean(draws), statistics.stdev(draws) / math.sqrt(len(draws))
    assert abs(expected_duration("lognormal", 2.0, sigma) - mean) < 4 * sem
    assert expected_duration("fixed", 2.0, 0.0) == 2.0


def test_warmup_ends_when_the_in_flight_age_settles():
    rng = random.Random(0)
    ages = [min(s * 0.4, 2.0) + rng.uniform(-0.05, 0.05) for s in range(20)]
    end = warmup_end(ages, 3, 15)
    assert end is not None and 6 <= end <= 12
    assert warmup_end(ages[:4], 3, 15) is None  # not decided yet
    assert warmup_end([float(s) for s in range(20)], 3, 15) == 15  # never settles: the cap

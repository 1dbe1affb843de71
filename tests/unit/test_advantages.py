"""Group statistics are taken per rollout, not per row: a rollout whose calls split into
several rows gets the advantage it would get as one row, for GRPO and RLOO."""

from __future__ import annotations

import statistics

import pytest
import torch

from workers.trainer.algorithms import compute_advantages
from workers.trainer.batch import Sample
from workers.trainer.verl_batch import to_verl_batch

REWARDS = [1.0, 0.0, 0.5, 0.25]


def group(split_first: bool) -> list[Sample]:
    out = []
    for i, reward in enumerate(REWARDS):
        rid = f"g0.{i}"
        if i == 0 and split_first:
            # three calls whose prompts do not extend each other (the agent rewrote its
            # history): three rows of one rollout
            for k in range(3):
                out.append(Sample([1, 10 + k, 4], [5, 6], [-1.0, -1.0], reward, "g0", 1.0, 0,
                                  rid))
        else:
            out.append(Sample([1, 3, 4], [5, 6], [-1.0, -1.0], reward, "g0", 1.0, 0, rid))
    return out


def per_rollout(estimator: str, split_first: bool) -> dict[str, float]:
    vb = to_verl_batch(group(split_first), 0)
    adv = compute_advantages(estimator, vb.rewards, vb.response_mask, vb.group_ids, True,
                             vb.rollout_ids)
    out: dict[str, float] = {}
    for i, rid in enumerate(vb.rollout_ids):
        value = float(adv[i, 0])
        assert out.setdefault(rid, value) == pytest.approx(value)  # one value per rollout
        assert torch.all(adv[i] == value * vb.response_mask[i])
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_split_rollout_gets_the_packed_advantage(estimator):
    split = per_rollout(estimator, split_first=True)
    packed = per_rollout(estimator, split_first=False)
    assert len(to_verl_batch(group(True), 0)) == 6  # the first rollout spans 3 rows
    assert split == pytest.approx(packed)
    if estimator == "rloo":  # leave-one-out over the other 3 rollouts
        assert packed["g0.0"] == pytest.approx(1.0 - (0.0 + 0.5 + 0.25) / 3)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_rollout_without_a_row_stays_in_its_group_baseline(estimator):
    # rewards 1.0, 0.0, 0.5 trained; a fourth rollout of the group failed before its first
    # call (no row) and scored 0: the statistics are over all four
    samples = [s for s in group(split_first=False) if s.rollout_id != "g0.3"]
    vb = to_verl_batch(samples, 0, rowless=[("g0", 0.0)])
    adv = compute_advantages(estimator, vb.rewards, vb.response_mask, vb.group_ids, True,
                             vb.rollout_ids, vb.rowless)
    got = [float(adv[i, 0]) for i in range(3)]
    everyone = [1.0, 0.0, 0.5, 0.0]
    if estimator == "grpo":
        mean, std = statistics.fmean(everyone), statistics.stdev(everyone)
        want = [(r - mean) / (std + 1e-6) for r in everyone[:3]]
    else:
        want = [r - (sum(everyone) - r) / 3 for r in everyone[:3]]
    assert got == pytest.approx(want, abs=1e-5)
    # left out of the baseline (as before), the same rollouts would get other advantages
    without = compute_advantages(estimator, vb.rewards, vb.response_mask, vb.group_ids, True,
                                 vb.rollout_ids)
    assert float(without[0, 0]) != pytest.approx(got[0], abs=1e-3)

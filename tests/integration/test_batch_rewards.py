"""What the trainer makes of a group's rewards, read from real Redis records: every rollout
with a reward stays in its group's baseline, a group with a single reward is not trained,
and calls cut at ``max_tokens`` are counted, masked out or penalised as configured."""

from __future__ import annotations

import pytest
import torch

from app.state import keys
from app.state.records import CapturedCall, SiblingResult
from workers.trainer.algorithms import compute_advantages
from workers.trainer.batch import Overlong, collect_samples
from workers.trainer.verl_batch import to_verl_batch


def _call(n_tokens: int, finish: str, prompt: list[int] | None = None) -> CapturedCall:
    return CapturedCall(prompt or [1, 3, 4], [5] * n_tokens, [-1.0] * n_tokens, finish, 0, 1.0,
                        "u", 0.0, 0.0, "chat.completions")


def _group(client, gid: str, rollouts: list[tuple[str, float | None, list[CapturedCall]]]
           ) -> None:
    """``rollouts``: (status, reward, calls) per sibling."""
    for i, (status, reward, calls) in enumerate(rollouts):
        rid = f"{gid}.{i}.a"
        client.hset(keys.group_results(gid), str(i), SiblingResult(
            i, rid, status, reward, 1, 0.1, error=None if status == "ok" else "boom"
        ).to_json())
        for call in calls:
            client.rpush(keys.rollout_calls(rid), call.to_json())


def test_a_failure_before_the_first_call_stays_in_the_baseline(redis_client):
    _group(redis_client, "g", [("ok", 1.0, [_call(2, "stop")]), ("ok", 0.0, [_call(2, "stop")]),
                               ("failed", None, [])])
    samples, stats = collect_samples(redis_client, ["g"], zero_reward_failures=True,
                                     min_group_rewards=2)
    assert len(samples) == 2 and stats.rowless == [("g", 0.0)]
    assert stats.failed_rollouts_zero_reward == 1 and stats.rewards == [1.0, 0.0, 0.0]
    vb = to_verl_batch(samples, 0, stats.rowless)
    adv = compute_advantages("grpo", vb.rewards, vb.response_mask, vb.group_ids, True,
                             vb.rollout_ids, vb.rowless)
    # by hand over the three rewards 1, 0, 0: mean 1/3, sample std sqrt(1/3)
    std = (1 / 3) ** 0.5
    assert adv[:, 0].tolist() == pytest.approx([(2 / 3) / std, (-1 / 3) / std], abs=1e-5)


def test_a_group_with_one_reward_is_not_trained(redis_client):
    _group(redis_client, "lone", [("ok", 1.0, [_call(2, "stop")]), ("failed", None, [])])
    _group(redis_client, "pair", [("ok", 1.0, [_call(2, "stop")]), ("ok", 0.5, [_call(2, "stop")])])
    samples, stats = collect_samples(redis_client, ["lone", "pair"], zero_reward_failures=False,
                                     min_group_rewards=2)
    assert {s.group_id for s in samples} == {"pair"}
    assert stats.small_groups == 1
    # an estimator that needs no group trains it
    samples, stats = collect_samples(redis_client, ["lone", "pair"], zero_reward_failures=False,
                                     min_group_rewards=1)
    assert {s.group_id for s in samples} == {"lone", "pair"} and stats.small_groups == 0


def test_over_long_calls_are_counted_and_masked(redis_client):
    # rollout 0: a short first turn, then a second turn cut at max_tokens (one row);
    # rollout 1: a single call cut at max_tokens; rollout 2: a clean answer
    first = _call(2, "stop")
    second = _call(3, "length", first.prompt_ids + first.response_ids + [7])
    _group(redis_client, "g", [("ok", 1.0, [first, second]), ("ok", 0.5, [_call(4, "length")]),
                               ("ok", 0.0, [_call(1, "stop")])])
    samples, stats = collect_samples(redis_client, ["g"], True, 2, Overlong(mask=False))
    assert stats.overlong_calls == 2 and stats.overlong_masked_calls == 0
    assert all(s.trained for s in samples)

    samples, stats = collect_samples(redis_client, ["g"], True, 2, Overlong(mask=True))
    assert stats.overlong_calls == 2 and stats.overlong_masked_calls == 2
    # rollout 1 trains nothing: it leaves the batch but keeps its reward in the baseline
    assert stats.rowless == [("g", 0.5)]
    vb = to_verl_batch(samples, 0, stats.rowless)
    assert len(vb) == 2 and vb.calls == [2, 1]
    # the cut second turn stays in its row as context, out of the loss
    row = vb.response_mask[0]
    assert int(row.sum()) == 2 and int(vb.response_attention[0].sum()) == 2 + 1 + 3
    assert torch.count_nonzero(vb.rollout_log_probs[0]) == 5  # every sampled token's log-prob


def test_soft_over_long_penalty_is_dapos():
    shape = Overlong(buffer_len=4, penalty_factor=0.5, max_response_length=10)
    assert [shape.penalty(n) for n in (3, 6, 7, 8, 10, 12)] == \
        pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    assert Overlong().penalty(10_000) == 0.0


def test_the_penalty_of_the_longest_call_shapes_the_reward(redis_client):
    _group(redis_client, "g", [("ok", 1.0, [_call(2, "stop"), _call(9, "stop", [9, 9, 9])]),
                               ("ok", 1.0, [_call(5, "stop")])])
    shape = Overlong(buffer_len=4, penalty_factor=1.0, max_response_length=10)
    samples, stats = collect_samples(redis_client, ["g"], True, 2, shape)
    assert [s.reward for s in samples] == pytest.approx([0.25, 0.25, 1.0])
    assert stats.penalties == pytest.approx([-0.75, 0.0]) and stats.rewards == [1.0, 1.0]


def test_a_step_of_rollouts_that_all_failed_before_their_first_call_goes_through(
        redis_client):
    """``controller.on_failure: zero_reward`` and every rollout of the step failed before its
    first model call (a sandbox that would not start): nothing to train, and the step goes
    through empty. As an error it failed again at every ``--resume``, for ever."""
    from app.config import load_config
    from workers.trainer.settings import TrainerSettings
    from workers.trainer.step import StepError, claim

    settings = TrainerSettings.from_config(load_config(None, ["controller.on_failure=zero_reward"]))
    run = "empty-step-run"
    _group(redis_client, "empty-a", [("failed", None, []), ("failed", None, [])])
    redis_client.rpush(keys.run_step_groups(run, 0), "empty-a")
    group_ids, samples, stats = claim(redis_client, run, 0, settings)
    assert group_ids == ["empty-a"] and samples == []
    assert stats.rollouts == 2 and stats.rowless == [("empty-a", 0.0), ("empty-a", 0.0)]
    # a step whose groups hold no rollout at all is still an error
    redis_client.rpush(keys.run_step_groups(run, 1), "empty-none")
    with pytest.raises(StepError, match="no rollouts in 1 groups"):
        claim(redis_client, run, 1, settings)

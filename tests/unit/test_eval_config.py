"""Evaluation settings: validated at start, and turned into an evaluation run's config."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_config
from app.driver.evaluation import eval_config, eval_temperature


def test_test_freq_needs_held_out_prompts():
    with pytest.raises(ConfigError, match=r"trainer.test_freq: value 5 needs data.val_files"):
        load_config(None, ["trainer.test_freq=5"])


@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_test_freq_is_positive_or_never(value):
    with pytest.raises(ConfigError, match=r"trainer.test_freq: value .* positive integer, or -1"):
        load_config(None, [f"trainer.test_freq={value}"])


def test_sampled_evaluation_needs_a_temperature():
    with pytest.raises(ConfigError, match=r"val_kwargs.temperature: value 0 cannot sample"):
        load_config(None, ["actor_rollout_ref.rollout.val_kwargs.do_sample=true"])


def test_greedy_unless_sampled():
    assert eval_temperature(load_config(None, [
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7"])) == 0.0
    assert eval_temperature(load_config(None, [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7"])) == 0.7


def test_the_evaluation_run_visits_every_held_out_prompt_once():
    cfg = load_config(None, ["data.val_files=examples/arith/data/val.jsonl",
                             "trainer.test_freq=5", "controller.on_failure=requeue"])
    plain = eval_config(cfg, 30)
    assert plain["data"]["train_files"] == "examples/arith/data/val.jsonl"
    assert plain["data"]["train_batch_size"] == 30 and plain["data"]["shuffle"] is False
    assert plain["agentlightning"]["async_rollout"]["enabled"] is False
    # a failed evaluation rollout scores 0: it is never re-queued
    assert plain["controller"]["on_failure"] == "zero_reward"
    load_config(base=plain)  # what the workers load back must validate


def test_a_held_out_set_smaller_than_the_mini_batch_validates():
    """verl's ``ppo_mini_batch_size: 16`` with 10 held-out prompts: the evaluation run's
    config (read back by every worker and the driver) failed the batch rules, and the run
    died at its first evaluation."""
    cfg = load_config(None, ["data.val_files=examples/arith/data/val.jsonl",
                             "trainer.test_freq=5", "data.train_batch_size=32",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                             "agentlightning.async_rollout.async_train_batch_size=48"])
    load_config(base=eval_config(cfg, 10))

"""The estimator and policy-loss names validation accepts are verl's own."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_config
from app.config.verl_names import ADV_ESTIMATORS, POLICY_LOSSES, POLICY_LOSSES_LEFT_OUT


def test_the_policy_losses_are_verls_registry():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert set(POLICY_LOSSES) | set(POLICY_LOSSES_LEFT_OUT) == set(POLICY_LOSS_REGISTRY)
    assert not set(POLICY_LOSSES) & set(POLICY_LOSSES_LEFT_OUT)


def test_the_estimators_are_registered_in_verl():
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    assert set(ADV_ESTIMATORS) <= set(ADV_ESTIMATOR_REGISTRY)
    assert set(ADV_ESTIMATORS) <= {e.value for e in AdvantageEstimator}


@pytest.mark.parametrize("name", POLICY_LOSSES_LEFT_OUT)
def test_a_left_out_loss_is_refused_by_validation(name):
    with pytest.raises(ConfigError, match="loss_mode"):
        load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"])


def test_the_rejection_options_are_verls():
    from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

    from app.config.verl_names import ROLLOUT_RS_OPTIONS

    assert set(ROLLOUT_RS_OPTIONS) == SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("rs, threshold, named", [
    ("token", "2", "rollout_rs"),                 # verl has no such option
    ("token_k1,geometric", "2", "rollout_rs"),
    ("token_k1", "null", "rollout_rs_threshold"),  # required with an option
    ("token_k1,seq_mean_k2", "'2,3,4'", "rollout_rs_threshold"),  # one, or one per option
    ("seq_mean_k2", "'0.5_2'", "rollout_rs_threshold"),  # lower_upper only for *_k1
    ("token_k1", "-1", "rollout_rs_threshold"),
    ("token_k1", "0.5", "rollout_rs_threshold"),  # verl reads 1/0.5 to 0.5: lower > upper
    ("seq_mean_k1", "'3_2'", "rollout_rs_threshold"),
    ("token_k1,token_k1", "'2,3'", "rollout_rs_threshold"),  # one name, so one threshold
])
def test_a_rejection_setting_verl_would_refuse_is_a_config_error(rs, threshold, named):
    with pytest.raises(ConfigError, match=f"algorithm.rollout_correction.{named}:"):
        load_config(None, [f"algorithm.rollout_correction.rollout_rs={rs}",
                           f"algorithm.rollout_correction.rollout_rs_threshold={threshold}"])


@pytest.mark.parametrize("rs, threshold", [
    ("token_k1", "2"), ("token_k1", "1"), ("token_k1,", "2"), ("seq_max_k2", "inf"),
    ("token_k1,seq_max_k2", "'0.5_2,5'"), ("seq_sum_k1", "'0.2_4'"),
    ("token_k1,token_k1,token_k2", "'2,3'"),
])
def test_what_verl_takes_is_taken(rs, threshold):
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_rs_thresholds

    cfg = load_config(None, [f"algorithm.rollout_correction.rollout_rs={rs}",
                             f"algorithm.rollout_correction.rollout_rs_threshold={threshold}"])
    rc = cfg.algorithm.rollout_correction
    names = list(dict.fromkeys(n for n in rs.split(",") if n))  # as verl reads them
    _parse_rollout_rs_thresholds(names, rc.rollout_rs_threshold)

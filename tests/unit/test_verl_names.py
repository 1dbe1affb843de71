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

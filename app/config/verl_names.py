"""The names the configuration takes from verl's registries
(``verl.trainer.ppo.core_algos``): advantage estimators and policy losses.

They are listed here so that validation imports neither torch nor verl (the CLI stays
light); ``tests/unit/test_verl_names.py`` compares them with the registries of the verl the
project pins, so a verl upgrade that adds, renames or drops a name fails a test instead of
drifting.
"""

from __future__ import annotations

# ADV_ESTIMATOR_REGISTRY names the trainer computes (``workers.trainer.algorithms``): an
# outcome reward, one score per rollout, normalised within its prompt group; True marks a
# group-relative estimator (it needs actor_rollout_ref.rollout.n >= 2). The others need
# what the trainer does not have (a critic's values for gae, per-token rewards, ...).
ADV_ESTIMATORS: dict[str, bool] = {"grpo": True, "rloo": True}

# POLICY_LOSS_REGISTRY, every name but those this trainer cannot feed, with why.
POLICY_LOSSES_LEFT_OUT: dict[str, str] = {
    "bypass_mode": "not a loss_mode here: algorithm.rollout_correction.bypass_mode selects "
                   "it, with the correction settings it reads",
}
# verl's rejection-sampling criteria (rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS):
# ``rollout_rs`` names one, or several joined by commas (a token must pass every one); the
# *_k1 ones bound the ratio from both sides (a threshold "lower_upper", or 1/upper below).
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

POLICY_LOSSES: tuple[str, ...] = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg",
                                  "clip_cov", "kl_cov", "geo_mean", "dro", "cispo")

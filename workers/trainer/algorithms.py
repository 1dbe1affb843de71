"""The algorithm functions the update uses, each a small function of its inputs.

verl supplies the estimators (by registry name), the rollout-correction weights and
metrics; these functions adapt them to the trainer's rows (a rollout may span several) and
add the learning-rate schedule. The engine path (``engine.py``) calls them on the controller
side; the single-process reference in ``bench/reference.py`` calls the same ones, so the two
paths differ only in how the model is run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from app.config.schema import Config, RolloutCorrectionConfig


def compute_advantages(estimator: str, rewards: torch.Tensor, response_mask: torch.Tensor,
                       group_ids: list[str], norm_by_std: bool,
                       rollout_ids: list[str] | None = None,
                       rowless: Sequence[tuple[str, float]] = ()) -> torch.Tensor:
    """Per-token advantages of each row, from one score per rollout.

    A rollout whose calls could not share one row (the agent rewrote its history) spans
    several rows with the same reward. Group statistics (GRPO's mean and std, RLOO's
    leave-one-out baseline) are taken over the group's rollouts, one score each, never over
    rows: otherwise a rollout with more rows would weigh more, and RLOO's baseline would hold
    the rollout's own other rows. Each row gets its rollout's advantage on its response tokens.
    A row without a rollout id counts as a rollout of its own.

    ``rowless``: (group id, reward) of the group's other rollouts, those that left no row (a
    failure before the first call, scored 0, or every call excluded). They have a reward, so
    they are part of the group's statistics: without them a group's mean and std would be
    taken over the survivors only, and a group left with one row would train on its raw
    reward.
    """
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    keys = [rid if rid else f"row:{i}" for i, rid in enumerate(rollout_ids or [""] * len(rewards))]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    rows = list(first.values())
    fn = get_adv_estimator_fn(estimator)
    # Outcome reward: one token per rollout carries it; the rowless rollouts come last, and
    # their advantages are computed only to be dropped.
    scores = torch.cat([rewards[rows].to(torch.float32),
                        torch.tensor([r for _, r in rowless], dtype=torch.float32)])
    index = [group_ids[i] for i in rows] + [g for g, _ in rowless]
    ones = torch.ones((len(index), 1), dtype=response_mask.dtype)
    kwargs: dict[str, Any] = {"token_level_rewards": scores.unsqueeze(-1).to(ones.dtype),
                              "response_mask": ones,
                              "index": np.array(index, dtype=object)}
    if "norm_adv_by_std_in_grpo" in inspect.signature(fn).parameters:
        kwargs["norm_adv_by_std_in_grpo"] = norm_by_std
    per_rollout, _ = fn(**kwargs)
    score = {k: per_rollout[j, 0] for j, k in enumerate(first)}
    per_row = torch.stack([score[k] for k in keys])
    return per_row.unsqueeze(-1) * response_mask


def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                       response_mask: torch.Tensor, rc: RolloutCorrectionConfig
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, response mask after rejection, rollout_corr/* metrics)."""
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_rollout_corr_metrics_from_logprobs,
        compute_rollout_correction_and_rejection_mask,
    )

    if rc.rollout_is is None and rc.rollout_rs is None:
        metrics = compute_rollout_corr_metrics_from_logprobs(
            log_prob=old_log_prob, rollout_log_prob=rollout_log_prob,
            response_mask=response_mask)
        return None, response_mask, metrics
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob,
        response_mask=response_mask, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)
    w = weights.batch["rollout_is_weights"] if weights is not None else None
    return w, mask, metrics


def constrained_is_metrics(is_weights: torch.Tensor | None, mask: torch.Tensor,
                           constrained: torch.Tensor | None) -> dict[str, float]:
    """The importance weights of the tokens sampled under a grammar mask (structured
    outputs, a required tool call): their log-probs are the masked distribution's, so a
    token's weight against the unmasked policy is about the probability mass the mask kept
    there (at most 1): how far the grammar moved the sampling."""
    if constrained is None:
        return {}
    at = constrained * mask
    n = float(at.sum())
    out = {"rollout_corr/constrained_token_fraction": n / max(float(mask.sum()), 1.0)}
    if is_weights is not None and n > 0:
        out["rollout_corr/constrained_is_mean"] = float((is_weights * at).sum()) / n
    return out


def lr_at(cfg: Config, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): a pure function of the step,
    so a restored or restarted trainer follows the same schedule."""
    actor = cfg.actor_rollout_ref.actor
    lr = float(actor.lr)
    if actor.lr_schedule == "constant":
        return lr
    total = max(int(cfg.trainer.total_steps) - 1, 1)
    progress = min(max(step, 0) / total, 1.0)
    floor = lr * float(actor.min_lr_ratio)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

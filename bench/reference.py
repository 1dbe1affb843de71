"""The single-process reference update, for tests and benchmarks only.

The trainer trains on verl's engine (``workers/trainer/engine.py``). ``PolicyTrainer`` here
is the plain single-process path (one Hugging Face model and a torch AdamW around verl's
loss functions): the reference the engine path is tested and benchmarked against, not a
trainer users run, so it lives outside the packages that ship.

It uses the same algorithm functions as the engine (``workers.trainer.algorithms``) and
verl's PPO clipped policy loss, ``agg_loss`` and KL penalty; what is its own is the glue a
CPU trainer needs: the resident model and optimizer, log-probs under the same temperature
the rollouts were sampled with, mini-batches and the optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from workers.trainer.algorithms import compute_advantages, lr_at, rollout_correction
from workers.trainer.batch import Batch
from workers.trainer.engine_config import pick_device

log = logging.getLogger(__name__)


def _actor_config(actor: Any) -> Any:
    from verl.workers.config import ActorConfig

    # verl validates micro-batch settings meant for its FSDP workers; they do not apply to
    # this single-process trainer, so they are given harmless values.
    return ActorConfig(strategy="fsdp", clip_ratio=float(actor.clip_ratio),
                       clip_ratio_low=float(actor.clip_ratio),
                       clip_ratio_high=float(actor.clip_ratio),
                       loss_agg_mode=str(actor.loss_agg_mode), rollout_n=1,
                       ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                       use_torch_compile=False)


def token_log_probs(model: torch.nn.Module, batch: Batch, with_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under ``model`` at each sample's sampling temperature, [B, R]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   use_cache=False).logits.float()
    # Gather only the positions that predict response tokens before the softmax.
    idx = batch.response_index.unsqueeze(-1).expand(-1, -1, logits.size(-1))
    logits = torch.gather(logits, 1, idx) / batch.temperatures.unsqueeze(-1)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, 2, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * batch.response_mask, entropy


class PolicyTrainer:
    """Model, optimizer and (optional) frozen reference, resident across updates."""

    def __init__(self, cfg: Any, model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = pick_device(cfg.trainer.device)
        if self.device == "cpu" and int(cfg.trainer.cpu_threads):
            torch.set_num_threads(int(cfg.trainer.cpu_threads))
        actor = cfg.actor_rollout_ref.actor
        torch.manual_seed(int(cfg.data.seed))
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(actor.lr),
                                           weight_decay=float(actor.weight_decay))
        self.ref = None
        if actor.use_kl_loss:
            self.ref = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.float32).to(self.device).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.actor_cfg = _actor_config(actor)
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def lr_at(self, step: int) -> float:
        return lr_at(self.cfg, step)

    def update(self, batch: Batch, step: int = 0) -> dict[str, float]:
        from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

        actor = self.cfg.actor_rollout_ref.actor
        algo = self.cfg.algorithm
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        groups = sorted(set(batch.group_ids))
        per_mb = int(actor.ppo_mini_batch_size) or len(groups)
        # One pass over one mini-batch: the "old" log-probs are the pass's own, detached
        # (identical values), so the separate no-grad forward is skipped (a third of the work).
        single_pass = int(actor.ppo_epochs) == 1 and per_mb >= len(groups)
        first: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if single_pass:
            first = token_log_probs(self.model, batch, with_entropy=actor.entropy_coeff > 0)
            old_log_prob = first[0].detach()
        with torch.no_grad():
            if not single_pass:
                old_log_prob, _ = token_log_probs(self.model, batch)
            ref_log_prob = token_log_probs(self.ref, batch)[0] if self.ref is not None else None
        mask = batch.response_mask
        advantages = compute_advantages(algo.adv_estimator, batch.rewards, mask,
                                        batch.group_ids, bool(algo.norm_adv_by_std_in_grpo),
                                        batch.rollout_ids)
        is_weights, mask, rc_metrics = rollout_correction(
            old_log_prob, batch.rollout_log_probs, mask, algo.rollout_correction)
        policy_loss = get_policy_loss_fn("vanilla")

        metrics: dict[str, list[float]] = {}
        for _ in range(int(actor.ppo_epochs)):
            for start in range(0, len(groups), per_mb):
                chosen = set(groups[start:start + per_mb])
                rows = [i for i, g in enumerate(batch.group_ids) if g in chosen]
                mb = batch.select(rows)
                r = torch.as_tensor(rows)
                if first is not None:
                    log_prob, entropy = first  # rows == the whole batch
                else:
                    log_prob, entropy = token_log_probs(self.model, mb,
                                                        with_entropy=actor.entropy_coeff > 0)
                pg_loss, pg_metrics = policy_loss(
                    old_log_prob[r], log_prob, advantages[r], mask[r], actor.loss_agg_mode,
                    self.actor_cfg,
                    rollout_is_weights=is_weights[r] if is_weights is not None else None)
                loss = pg_loss
                if entropy is not None:
                    ent = agg_loss(entropy, mask[r], actor.loss_agg_mode)
                    loss = loss - float(actor.entropy_coeff) * ent
                    pg_metrics["actor/entropy"] = ent.item()
                if ref_log_prob is not None:
                    kl = kl_penalty(log_prob, ref_log_prob[r], actor.kl_loss_type)
                    kl_loss = agg_loss(kl, mask[r], actor.loss_agg_mode)
                    loss = loss + float(actor.kl_loss_coef) * kl_loss
                    pg_metrics["actor/kl_loss"] = kl_loss.item()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                           float(actor.grad_clip))
                self.optimizer.step()
                pg_metrics.update({"actor/pg_loss": pg_loss.item(),
                                   "actor/grad_norm": float(grad_norm)})
                for k, v in pg_metrics.items():
                    metrics.setdefault(k, []).append(float(v))
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out.update({k: float(v) for k, v in rc_metrics.items()})
        out["actor/lr"] = lr
        out["actor/advantage_abs_mean"] = float(
            (advantages.abs() * batch.response_mask).sum() / batch.response_mask.sum())
        out["batch/rows"] = float(len(batch))
        # per model call (a row may hold several turns of one rollout)
        out["actor/response_length_mean"] = float(
            batch.response_mask.sum() / max(sum(batch.calls), 1))
        return out

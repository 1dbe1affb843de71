"""The update with verl's algorithm code: IS weights as verl defines them, and one step that
moves log-probs in the direction of the advantage."""

from __future__ import annotations

import torch

from app.config import load_config
from app.config.loader import REPO_ROOT
from bench.reference import PolicyTrainer, token_log_probs
from workers.trainer.algorithms import rollout_correction
from workers.trainer.batch import Sample, to_batch

MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")


def test_token_is_weights_are_verls_truncated_ratio():
    torch.manual_seed(0)
    old = torch.randn(6, 5) - 3
    rollout = old + 0.8 * torch.randn(6, 5)
    mask = torch.ones(6, 5)
    mask[0, 3:] = 0
    cfg = load_config()
    weights, new_mask, metrics = rollout_correction(old, rollout, mask,
                                                    cfg.algorithm.rollout_correction)
    expected = torch.clamp(torch.exp(old - rollout), max=2.0) * mask
    assert torch.allclose(weights, expected, atol=1e-6)
    assert torch.equal(new_mask, mask)
    assert metrics["rollout_corr/rollout_is_max"] <= 2.0
    assert len([k for k in metrics if k.startswith("rollout_corr/")]) >= 20
    off = load_config(None, ["algorithm.rollout_correction.rollout_is=null"])
    weights, new_mask, metrics = rollout_correction(old, rollout, mask,
                                                    off.algorithm.rollout_correction)
    assert weights is None and torch.equal(new_mask, mask)
    assert "rollout_corr/kl" in metrics  # still measured when off


def test_one_update_follows_the_advantage():
    cfg = load_config(None, ["actor_rollout_ref.actor.lr=1e-2"])
    trainer = PolicyTrainer(cfg, MODEL)
    prompt = [1, 17, 15, 7, 14, 21, 3, 4, 5, 2, 21, 1, 3, 15, 15, 9, 15, 16, 3, 12, 16, 21]
    good, bad = [5, 4, 3, 2], [6, 6, 6, 2]
    samples = []
    with torch.no_grad():
        for resp, reward in ((good, 1.0), (bad, 0.0), (good, 1.0), (bad, 0.0)):
            samples.append(Sample(prompt, resp, [0.0] * 4, reward, "g0", 1.0, 0))
        b = to_batch(samples, 0)
        before, _ = token_log_probs(trainer.model, b)
    # rollout log-probs equal to the trainer's: on-policy, IS weights 1
    for s, row in zip(samples, before, strict=True):
        s.rollout_logprobs = row[: len(s.response_ids)].tolist()
    metrics = trainer.update(to_batch(samples, 0))
    with torch.no_grad():
        after, _ = token_log_probs(trainer.model, b)
    gain = (after - before).sum(-1)
    assert gain[0] > 0 and gain[2] > 0  # positive advantage: more likely
    assert gain[1] < 0 and gain[3] < 0  # negative advantage: less likely
    assert metrics["rollout_corr/rollout_is_mean"] == 1.0
    assert "actor/pg_loss" in metrics and "actor/grad_norm" in metrics


def test_lr_schedule_is_a_function_of_the_step():
    from types import SimpleNamespace

    cosine = load_config(None, ["actor_rollout_ref.actor.lr=1e-3", "trainer.total_steps=11",
                                "actor_rollout_ref.actor.lr_schedule=cosine",
                                "actor_rollout_ref.actor.min_lr_ratio=0.2"])
    lrs = [PolicyTrainer.lr_at(SimpleNamespace(cfg=cosine), s) for s in range(11)]
    assert abs(lrs[0] - 1e-3) < 1e-12 and abs(lrs[-1] - 2e-4) < 1e-12
    assert abs(lrs[5] - 6e-4) < 1e-12  # half way: the mean of the two ends
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    const = load_config(None, ["actor_rollout_ref.actor.lr=1e-3"])
    assert {PolicyTrainer.lr_at(SimpleNamespace(cfg=const), s) for s in (0, 7, 99)} == {1e-3}


def test_rejection_sampling_takes_verls_options():
    """rollout_rs names verl's rejection criteria (one, or several joined by commas): a
    token whose ratio falls outside the threshold's bounds leaves the mask."""
    old = torch.zeros(2, 4)
    rollout = old.clone()
    rollout[0, 1] = -3.0  # ratio e^3 = 20 > 2: rejected
    mask = torch.ones(2, 4)
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_rs=token_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=2"])
    _, new_mask, metrics = rollout_correction(old, rollout, mask,
                                              cfg.algorithm.rollout_correction)
    assert new_mask[0, 1] == 0 and new_mask.sum() == 7
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2",
                             "algorithm.rollout_correction.rollout_rs_threshold='0.5_2,5'"])
    _, new_mask, _ = rollout_correction(old, rollout, mask, cfg.algorithm.rollout_correction)
    assert new_mask[1].sum() == 4 and new_mask[0].sum() < 4

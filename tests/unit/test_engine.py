"""The update on verl's FSDP2 engine, against the single-process reference path and itself:
same log-probs and loss, the same step on 1 and 2 gloo ranks, micro-batching and padding
change nothing, a non-finite gradient is skipped, bf16 compute keeps fp32 master weights."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from app.config import load_config
from app.config.loader import REPO_ROOT
from bench.reference import PolicyTrainer, token_log_probs
from workers.trainer.batch import Sample, to_batch
from workers.trainer.engine import EngineTrainer
from workers.trainer.verl_batch import to_verl_batch

MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")
BASE = ["trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-3"]


def samples(seed: int = 0) -> list[Sample]:
    """4 groups x 3 rollouts at two temperatures, and one two-turn rollout sharing a row."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        for k in range(3):
            prompt = [1] + [rng.randint(3, 26) for _ in range(rng.randint(4, 9))]
            resp = [rng.randint(3, 26) for _ in range(rng.randint(2, 6))]
            out.append(Sample(prompt, resp, [-3.0 + rng.random() for _ in resp], rng.random(),
                              f"g{g}", 0.7 if g % 2 else 1.0, 0, f"r{g}{k}"))
    first = [1, 5, 6, 7]
    out.append(Sample(first, [8, 9], [-2.0, -2.5], 0.5, "g3", 0.7, 0, "mt"))
    out.append(Sample(first + [8, 9, 10, 11], [12, 13, 14], [-2.0] * 3, 0.5, "g3", 0.7, 0, "mt"))
    return out


def engine(*overrides: str) -> EngineTrainer:
    return EngineTrainer(load_config(None, [*BASE, *overrides]), MODEL)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def step_of(trainer: EngineTrainer) -> tuple[dict, dict]:
    """(metrics, new weights) of one update of ``samples()``; the trainer is closed after."""
    try:
        return trainer.update(to_verl_batch(samples(), 0), 0), trainer.full_weights()
    finally:
        trainer.close()


def assert_same_step(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    # The same gradient (a sum over ranks instead of a mean would double its norm) ...
    assert b[0]["actor/grad_norm"] == pytest.approx(a[0]["actor/grad_norm"], rel=1e-5)
    # ... and the same new weights: one AdamW step moves a weight by up to lr (1e-3); on
    # gradients near zero Adam's normalisation magnifies float rounding, hence 1% of a step.
    assert max_diff(a[1], b[1]) < 1e-5


@pytest.fixture(scope="module")
def one_rank() -> tuple[EngineTrainer, dict, dict]:
    """A 1-rank engine after one update of ``samples()``: (engine, metrics, new weights)."""
    trainer = engine()
    metrics = trainer.update(to_verl_batch(samples(), 0), 0)
    return trainer, metrics, trainer.full_weights()


def test_log_probs_equal_the_reference_forward():
    trainer = engine()
    ref = PolicyTrainer(load_config(None, BASE), MODEL)
    vb = to_verl_batch(samples(), 0)
    got = trainer.log_probs(vb)
    b = to_batch(samples(), 0)
    with torch.no_grad():
        want, _ = token_log_probs(ref.model.eval(), b)
    assert len(vb) == len(b) == 13  # the two-turn rollout shares one row
    for i in range(len(vb)):
        mine = got[i][vb.response_mask[i] > 0]
        theirs = want[i][b.response_mask[i] > 0]
        assert torch.allclose(mine, theirs, atol=1e-5), i
    # tokens between the two turns condition the second turn but are not scored
    row = vb.rollout_ids.index("mt")
    assert vb.response_mask[row].tolist()[:7] == [1, 1, 0, 0, 1, 1, 1]


def test_loss_and_gradient_equal_the_reference_update(one_rank):
    _, metrics, _ = one_rank
    ref = PolicyTrainer(load_config(None, BASE), MODEL)
    want = ref.update(to_batch(samples(), 0), 0)
    assert metrics["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(
        want["rollout_corr/rollout_is_mean"], rel=1e-5)


def test_two_gloo_ranks_give_the_same_step(one_rank):
    _, metrics, weights = one_rank
    assert_same_step((metrics, weights), step_of(engine("trainer.ranks=2")))


def sgd_step(*overrides: str, lr: float = 1e-3) -> tuple[dict, dict, dict]:
    """(metrics, weights before, weights after) of one plain SGD step on ``samples()``: the
    engine's optimizer is swapped for SGD (one rank, in this process), so the weights move by
    exactly ``-lr * gradient`` and compare gradients, where Adam's first step
    (``lr * g / (|g| + eps)``) turns a rounding difference on a near-zero gradient into up
    to ``lr`` itself."""
    trainer = engine(*overrides)
    inner = trainer.ranks.engine.actor.engine
    inner.optimizer = torch.optim.SGD(inner.module.parameters(), lr=lr)
    before = trainer.full_weights()
    try:
        metrics = trainer.update(to_verl_batch(samples(), 0), 0)
        return metrics, before, trainer.full_weights()
    finally:
        trainer.close()


def test_micro_batches_of_one_give_the_same_gradient():
    lr = 1e-3
    m_full, w0, full = sgd_step(lr=lr)
    m_micro, _, micro = sgd_step("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                                 lr=lr)
    assert m_micro["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-5)
    # Micro-batching only regroups the fp32 sums that make each gradient entry (over at
    # most every token of the batch, n of them): a reordered sum of n terms moves by at
    # most about n * u times their magnitude (u = 2**-24, fp32's unit roundoff), the
    # tensor's largest |g| (read off the full step) standing in for it. The new weight is
    # then rounded once in either run, half an ulp each, u * |w| together at most twice.
    # Per tensor: |dw| <= 2 * u * max|w| + lr * n * u * max|g|; the rounding of the
    # weights dominates (the gradient term is ~1e-12 here).
    u = torch.finfo(torch.float32).eps / 2
    n = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples())
    for k in full:
        g_max = (w0[k] - full[k]).abs().max().item() / lr
        bound = 2 * u * full[k].abs().max().item() + lr * n * u * g_max
        assert (full[k] - micro[k]).abs().max().item() <= bound, k


def test_padded_rows_change_nothing(one_rank):
    _, metrics, weights = one_rank
    padded = engine()
    vb = to_verl_batch(samples(), 0).padded_to(16)
    assert len(vb) == 16 and vb.real == 13 and vb.response_mask[13:].sum() == 0
    # the same step up to float rounding: a padded batch's matmuls block differently on
    # another CPU (a padded row in the loss's token count would move the norm by 13/16)
    assert_same_step((metrics, weights), (padded.update(vb, 0), padded.full_weights()))


def forward_shapes(trainer: EngineTrainer) -> list[tuple[int, int]]:
    """Records the [rows, tokens] of every forward the actor's model runs."""
    shapes: list[tuple[int, int]] = []
    module = trainer.ranks.ranks.engine.actor.engine.module
    module.register_forward_pre_hook(
        lambda _m, args, kw: shapes.append(tuple((kw.get("input_ids") if "input_ids" in kw
                                                  else args[0]).shape)), with_kwargs=True)
    return shapes


def test_micro_batches_are_even_and_hold_rows_of_like_length(one_rank):
    """13 rows at a micro-batch of 8 run as 2 x 7 (one padding row of two tokens), each
    micro-batch padded only to its own longest row; the log-probs come back in the rows'
    order and the step is the same."""
    _, metrics, weights = one_rank
    trainer = engine("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    shapes = forward_shapes(trainer)
    vb = to_verl_batch(samples(), 0)
    whole = engine()
    assert torch.allclose(trainer.log_probs(vb), whole.log_probs(vb), atol=1e-6)
    whole.close()
    lengths = sorted((vb.prompt_mask.sum(1) + vb.response_attention.sum(1)).tolist() + [2])
    assert shapes == [(7, max(lengths[:7])), (7, max(lengths[7:]))]
    shapes.clear()
    m = trainer.update(vb, 0)
    assert len(shapes) == 4 and sum(rows for rows, _ in shapes) == 28  # old + new log-probs
    assert m["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert max_diff(weights, trainer.full_weights()) < 1e-5
    trainer.close()


def test_a_non_finite_gradient_skips_the_step():
    trainer = engine()
    before = trainer.full_weights()
    bad = samples()
    bad[0].reward = float("nan")  # the group's advantages, loss and gradient become NaN
    m = trainer.update(to_verl_batch(bad, 0), 0)
    assert m["actor/skipped_steps"] == 1.0 and m["actor/skipped_steps_total"] == 1.0
    assert max_diff(before, trainer.full_weights()) == 0.0
    trainer.update(to_verl_batch(samples(), 0), 1)  # the next good batch trains
    assert max_diff(before, trainer.full_weights()) > 1e-4


def test_bf16_compute_keeps_fp32_master_weights():
    lr = 1e-6
    trainer = engine(f"actor_rollout_ref.actor.lr={lr}",
                     "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16")
    assert trainer.ranks.call("master_dtype") == ["float32"]
    before = trainer.full_weights()
    vb = to_verl_batch(samples(), 0)
    for step in range(100):
        trainer.update(vb, step)
    after = trainer.full_weights()
    moved = torch.cat([(after[k] - before[k]).abs().flatten() for k in before])
    assert moved.mean() > 20 * lr  # AdamW moves each weight by up to lr per step
    # Rounded to bf16 after every step, the same steps would leave nearly every weight where
    # it was: one step is far below bf16's spacing at these magnitudes.
    w = before["model.layers.0.mlp.up_proj.weight"].bfloat16()
    stepped = (w.float() + lr).bfloat16()
    assert (stepped == w).float().mean() > 0.95  # only weights near 0 have a finer spacing


def test_dynamic_batch_size_gives_the_same_gradient(one_rank):
    _, metrics, weights = one_rank
    dyn = engine("actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40")
    m = dyn.update(to_verl_batch(samples(), 0), 0)
    assert m["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert max_diff(weights, dyn.full_weights()) < 1e-5


@pytest.mark.parametrize("dynamic", [False, True])
def test_rows_longer_than_the_token_bound_run_alone(one_rank, dynamic, caplog):
    """A bound of 4 tokens, below every row: the old-log-prob pass and the update still run,
    with the same gradient. Cut by count, every forward holds one row; verl's token-count
    cut, which refuses a bound below its longest row, gets that row's length. The trainer
    warns once, naming the settings, and the step's metrics carry the bound."""
    _, metrics, _ = one_rank
    short = engine(f"actor_rollout_ref.actor.use_dynamic_bsz={str(dynamic).lower()}",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4")
    shapes = forward_shapes(short)
    vb = to_verl_batch(samples(), 0)
    with caplog.at_level(logging.WARNING, logger="workers.trainer.engine"):
        m = short.update(vb, 0)
        short.update(vb, 1)
    assert m["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    longest = int((vb.prompt_mask.sum(1) + vb.response_attention.sum(1)).max())
    assert max(width for _, width in shapes) == longest
    if not dynamic:
        assert {rows for rows, _ in shapes} == {1} and len(shapes) == 4 * len(vb)
    assert m["actor/max_token_len_per_gpu"] == 4.0
    warned = [r.getMessage() for r in caplog.records if "micro-batch bound" in r.getMessage()]
    assert len(warned) == 1  # the second step's rows are no longer
    assert f"a row of {longest} tokens is longer than the micro-batch bound of 4" in warned[0]
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in warned[0]
    assert "actor_rollout_ref.actor.micro_batch_memory_gb" in warned[0]


def test_the_auto_bound_sets_aside_the_fsdp_units_gathered(one_rank):
    """tiny-qwen2 (untied) as verl wraps it: the root (the final norm), the embedding, two
    decoder layers, the head. The auto bound sets aside the gradient and AdamW state and the
    root with the two largest units gathered, and the metrics carry the bound it gave."""
    from workers.trainer import token_budget as tb

    trainer, metrics, _ = one_rank
    layer = (128 * 128 + 128) + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 512 + 2 * 128
    units = trainer.ranks.call("fsdp_units")[0]
    assert units == [128, 27 * 128, layer, layer, 27 * 128]
    assert sum(units) == trainer.parameter_count()
    bound = trainer.ranks.call("token_bound")[0]
    assert bound["reserve_bytes"] == tb.step_reserve(units, sum(units), 1) == \
        12 * sum(units) + 8 * (128 + 2 * layer)
    assert metrics["actor/max_token_len_per_gpu"] == bound["max_token_len"] > 1000


def test_kl_loss_uses_a_frozen_reference():
    trainer = engine("actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.kl_loss_coef=0.1",
                     "actor_rollout_ref.actor.lr=1e-2")
    vb = to_verl_batch(samples(), 0)
    first = trainer.update(vb, 0)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    before_ref = trainer.log_probs(vb, ref=True)
    second = trainer.update(vb, 1)
    assert second["kl_loss"] > 1e-6  # the policy moved away from the reference ...
    assert torch.equal(before_ref, trainer.log_probs(vb, ref=True))  # ... which stays put


def test_policy_loss_mode_comes_from_config(one_rank):
    _, metrics, _ = one_rank
    gpg = engine("actor_rollout_ref.actor.policy_loss.loss_mode=gpg")
    m = gpg.update(to_verl_batch(samples(), 0), 0)
    # GPG weighs log-probs, vanilla PPO ratios (1 on the first step): the losses differ
    assert m["actor/pg_loss"] != pytest.approx(metrics["actor/pg_loss"], abs=1e-6)


def test_with_lora_the_reference_is_the_actor_without_its_adapter():
    """A KL loss with LoRA scores the reference through the actor with its adapter disabled
    (verl's way): no second copy of the base, and the reference stays the base model."""
    trainer = engine("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.lr=5e-2",
                     "actor_rollout_ref.actor.use_kl_loss=true")
    assert trainer.ranks.ranks.engine.ref is None
    vb = to_verl_batch(samples(), trainer.pad_id)
    ref, actor = trainer.log_probs(vb, ref=True), trainer.log_probs(vb)
    assert torch.equal(ref, actor)  # the adapter's B starts at zero
    for step in range(2):
        trainer.update(vb, step)
    assert torch.allclose(trainer.log_probs(vb, ref=True), ref, atol=1e-6)
    assert (trainer.log_probs(vb) - actor).abs().max() > 1e-3  # the adapter moved the actor


def test_bypass_mode_takes_the_rollout_log_probs_as_the_old_policy_s():
    """verl's bypass mode: no forward for the old log-probs (one pass over the rows, not
    two), PPO's ratio against the policy that sampled. With rollout log-probs equal to the
    engine's own, the step is the decoupled one; with others, the ratio moves off 1 and
    clips on the first step, where the decoupled ratio is exactly 1."""
    bypass = ("algorithm.rollout_correction.bypass_mode=true",
              "algorithm.rollout_correction.rollout_is=null")
    on_policy = samples()
    scorer = engine()
    lp = scorer.log_probs(to_verl_batch(on_policy, 0))
    scorer.close()
    vb = to_verl_batch(on_policy, 0)
    for i, s in enumerate(on_policy):  # rows follow the samples, the two-turn one aside
        if s.rollout_id != "mt":
            s.rollout_logprobs = lp[i][vb.response_mask[i] > 0].tolist()
    vb_on = to_verl_batch(on_policy, 0)
    row = vb_on.rollout_ids.index("mt")
    vb_on.rollout_log_probs[row] = lp[row] * vb_on.response_mask[row]

    decoupled = engine()
    m_dec = decoupled.update(vb_on, 0)
    w_dec = decoupled.full_weights()
    decoupled.close()
    trainer = engine(*bypass)
    shapes = forward_shapes(trainer)
    m_by = trainer.update(vb_on, 0)
    assert len(shapes) == 1  # the training pass only
    assert m_by["actor/grad_norm"] == pytest.approx(m_dec["actor/grad_norm"], rel=1e-4)
    assert max_diff(w_dec, trainer.full_weights()) < 1e-5
    trainer.close()

    off = engine(*bypass)
    m_off = off.update(to_verl_batch(samples(), 0), 0)  # rollout log-probs far from the policy
    off.close()
    assert m_dec["actor/pg_clipfrac"] == 0.0 and m_off["actor/pg_clipfrac"] > 0.1


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_no_micro_batch_is_made_only_of_rows_without_a_trained_token(ranks):
    """Padding rows (two tokens, the shortest) go one to a micro-batch: sorted with the rest
    they would share the first micro-batches, and a micro-batch with no trained token has
    nothing to normalise a per-micro-batch figure by (verl's bypass loss raises on it, and
    one rank raising hangs the others in their collectives)."""
    from workers.trainer.engine import _shards, layout

    base = to_verl_batch(samples(), 0)
    for rows in range(1, len(base) + 1):
        for micro in range(2, 9):
            total, size = layout(rows, ranks, micro)
            vb = base.select(list(range(rows))).padded_to(total)
            shards = _shards(vb, ranks, size)
            assert sorted(i for s in shards for i in s) == list(range(total))
            for shard in shards:
                assert len(shard) == total // ranks
                for start in range(0, len(shard), size):
                    chunk = shard[start:start + size]
                    if rows >= total // size:  # enough rows for every micro-batch
                        assert vb.response_mask[chunk].sum() > 0, (rows, micro, shard)


def test_rows_without_a_trained_token_are_not_run():
    """A row whose every call is masked (over-long, or rejected) adds nothing to the loss:
    it is left out of the training pass, and the step is the same. In bypass mode at one
    row per micro-batch it would otherwise be a micro-batch verl's loss refuses."""
    vb = to_verl_batch(samples(), 0)
    vb.response_mask[0] = 0
    vb.rollout_log_probs[0] = 0
    trainer = engine("algorithm.rollout_correction.bypass_mode=true",
                     "algorithm.rollout_correction.rollout_is=null",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    shapes = forward_shapes(trainer)
    m = trainer.update(vb, 0)
    assert len(shapes) == len(vb) - 1  # one row per micro-batch, the dead row left out
    whole = engine("algorithm.rollout_correction.bypass_mode=true",
                   "algorithm.rollout_correction.rollout_is=null")
    assert m["actor/grad_norm"] == pytest.approx(whole.update(vb, 0)["actor/grad_norm"],
                                                 rel=1e-5)
    trainer.close()
    whole.close()


def test_the_ranks_wait_in_a_collective_as_long_as_a_transfer_may_make_them(tmp_path):
    """The other ranks sit in the weight gather while rank 0 waits up to
    trainer.reload_timeout_s for each server (up to three posts each): their group's
    timeout covers every server's wait (NCCL's default, 10 min, was the default reload
    timeout itself)."""
    import subprocess
    import sys

    from workers.trainer.engine_config import collective_timeout_s

    cfg = load_config(None, ["inference.urls=[http://127.0.0.1:8100,http://127.0.0.1:8101,"
                             "http://127.0.0.1:8102]", "trainer.reload_timeout_s=1200"])
    assert collective_timeout_s(cfg) == 3 * (3 * 1200 + 180) + 600
    # never below gloo's own 30 min
    assert collective_timeout_s(load_config(None, ["trainer.reload_timeout_s=180"])) == 1800
    # a process of its own: this one may hold a group already
    code = ("import torch\n"
            "from torch.distributed import distributed_c10d as c\n"
            "from workers.trainer.ranks import free_port, init_process_group\n"
            "init_process_group(0, 1, free_port(), 'cpu', 4200.0)\n"
            "b = c._get_default_group()._get_backend(torch.device('cpu'))\n"
            "print(b.options._timeout.total_seconds())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 4200.0

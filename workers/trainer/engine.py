"""The policy update on verl's training engine: the trainer worker is its single controller.

The controller keeps the step logic, as verl's own SFT trainer and Tinker-style workers do:
which rows to train, the old and reference log-probs, advantages (verl's estimators by
registry name), rollout-correction weights (verl's helper), mini-batches and the learning
rate of each optimizer step (a pure function of the step). The engine owns the model,
sharding, micro-batches, the loss (verl's ``ppo_loss``), gradient clipping, skipping a
non-finite step, the per-tensor weight export and sharded checkpoints.

Invariants:
- Every mini-batch is padded with all-masked rows to divide evenly over ranks and
  micro-batches; padding never changes a loss or a gradient (``verl_batch``). The
  micro-batches are the fewest that ``ppo_micro_batch_size_per_gpu`` and the token bound
  (``ppo_max_token_len_per_gpu`` at the longest row's length) allow, made as even as the
  rows allow, so there are fewer padding rows than micro-batches, and they go one to a
  micro-batch; the other rows are sorted by length and dealt out to the ranks, since each
  micro-batch is padded to its longest row. Rows without a trained token are not trained.
- Mini-batches hold whole prompt groups (the GRPO/RLOO index never straddles two steps).
- A step whose gradient norm is not finite leaves the weights unchanged (verl skips the
  optimizer step) and is counted in ``actor/skipped_steps``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.config.schema import Config
from app.config.settings import launcher
from workers.trainer.algorithms import (
    compute_advantages,
    constrained_is_metrics,
    lr_at,
    rollout_correction,
)
from workers.trainer.engine_config import EngineSpec, engine_spec
from workers.trainer.ranks import LocalRanks, PerRank, RayRanks, SpawnedRanks, TokenBound
from workers.trainer.transfer import TransferResult
from workers.trainer.verl_batch import VerlBatch, to_verl_batch

log = logging.getLogger(__name__)


def _rank_group(cfg: Config, spec: EngineSpec) -> LocalRanks | SpawnedRanks | RayRanks:
    tr = cfg.trainer
    if launcher(cfg, spec.device) == "ray":
        return RayRanks(spec, int(tr.nnodes), int(tr.n_gpus_per_node), tr.ray_address)
    n = int(tr.ranks)
    return LocalRanks(spec) if n == 1 else SpawnedRanks(spec, n)


def layout(rows: int, ranks: int, micro: int | None) -> tuple[int, int | None]:
    """(rows after padding, rows per micro-batch) for ``rows`` over ``ranks``: the fewest
    micro-batches of at most ``micro`` rows on each rank, all of one size (verl requires it),
    as small as that allows. 10 rows at micro 8 run as 2 x 5, not as 2 x 8 with 6 padding
    rows. ``micro`` None = one micro-batch per rank (or verl's token-count cut)."""
    per_rank = -(-rows // ranks)
    if not micro:
        return per_rank * ranks, None
    count = -(-per_rank // micro)
    size = -(-per_rank // count)
    return ranks * count * size, size


def _shards(vb: VerlBatch, ranks: int, micro: int | None) -> list[list[int]]:
    """Row indices of ``vb`` for each rank (``vb`` divides evenly into ranks and micro-batches
    of ``micro`` rows): sorted by length and dealt out in turn, so a rank's consecutive
    micro-batches hold rows of like length (verl pads each micro-batch to its longest row)
    and every rank gets like work. Rows without a trained token (padding) go one to a
    micro-batch first: one made only of them has no token to normalise a per-micro-batch
    figure by (verl's bypass loss refuses it) and would be wasted work."""
    per = len(vb) // ranks
    size = min(micro or per, per)
    tokens = vb.response_mask.sum(1).tolist()
    lengths = _lengths(vb)
    by_length = sorted(range(len(vb)), key=lambda i: lengths[i])
    # position p of the dealt order -> rank p % ranks, micro-batch (p // ranks) // size
    slots = [[(g * size + t) * ranks + r for t in range(size)]
             for g in range(per // size) for r in range(ranks)]
    order: list[int | None] = [None] * len(vb)
    for j, row in enumerate(i for i in by_length if tokens[i] == 0):
        slot = j % len(slots)
        while order[slots[slot][-1]] is not None:  # that micro-batch is full of them
            slot = (slot + 1) % len(slots)
        order[next(p for p in slots[slot] if order[p] is None)] = row
    live = iter(i for i in by_length if tokens[i] > 0)
    filled = [p if p is not None else next(live) for p in order]
    return [filled[r::ranks] for r in range(ranks)]


def _lengths(vb: VerlBatch) -> list[int]:
    """Each row's tokens, prompt and response: what verl's forward runs over."""
    return (vb.prompt_mask.sum(1) + vb.response_attention.sum(1)).tolist()


def _memory_metrics(stage: str, per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {f"memory/trainer_rank{r}_{stage}_{k}": v
            for r, m in enumerate(per_rank) for k, v in m.items()}


def _bound_origin(bound: TokenBound) -> str:
    per_token = f"{bound['bytes_per_token'] / 1e6:.2f} MB a token"
    if "budget_bytes" not in bound:
        return f"ppo_max_token_len_per_gpu; {per_token}"
    budget = f"{bound['budget_bytes'] / 1e9:.2f} GB"
    if "available_bytes" not in bound:
        return f"micro_batch_memory_gb {budget} / {per_token}"
    return (f"micro_batch_memory_gb auto: {budget} of {bound['available_bytes'] / 1e9:.2f} GB "
            f"available less {bound['reserve_bytes'] / 1e9:.2f} GB the step adds / {per_token}")


class _OneCallAtATime:
    """The ranks, with one call in flight at a time: a step, a checkpoint written in the
    background and the upstream keeper (a weight transfer to a restarted server) run in
    different threads, and the ranks answer calls in the order they are sent."""

    def __init__(self, ranks: LocalRanks | SpawnedRanks | RayRanks) -> None:
        self.ranks = ranks
        self.size = ranks.size
        self.lock = threading.RLock()

    def call(self, method: str, per_rank: PerRank | None = None, **kwargs: object
             ) -> list[Any]:
        with self.lock:
            return self.ranks.call(method, per_rank, **kwargs)

    def close(self) -> None:
        with self.lock:
            self.ranks.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ranks, name)


class EngineTrainer:
    """verl's FSDP2 ``TrainingWorker`` (and a forward-only reference with a KL loss),
    resident across updates."""

    def __init__(self, cfg: Config, model_path: str) -> None:
        from transformers import AutoConfig

        self.cfg = cfg
        hf = AutoConfig.from_pretrained(model_path)
        self.pad_id = int(hf.pad_token_id if hf.pad_token_id is not None else 0)
        self.spec = engine_spec(cfg, model_path, self.pad_id)
        self.device = self.spec.device
        t = time.monotonic()
        # verl prints its progress to stdout; a command whose stdout is data (a benchmark's
        # JSON) gets it on stderr instead
        with contextlib.redirect_stdout(sys.stderr):
            self.ranks = _OneCallAtATime(_rank_group(cfg, self.spec))
        log.info("verl FSDP2 engine on %s: %d rank(s) (%s), compute %s, built in %.1f s",
                 self.device, self.ranks.size, type(self.ranks.ranks).__name__,
                 self.spec.compute_dtype, time.monotonic() - t)
        # every rank cuts by the same bound: the tightest any rank found
        bounds = self.ranks.call("token_bound")
        self.token_bound = min(bounds, key=lambda b: b["max_token_len"])
        self.max_token_len = int(self.token_bound["max_token_len"])
        log.info("micro-batches: %s, at most %d tokens per rank (%s)",
                 "verl's token-count cut" if self.spec.use_dynamic_bsz else
                 "rows of like length, as many as fit", self.max_token_len,
                 _bound_origin(self.token_bound))
        self.skipped_steps = 0
        self.longest_warned = self.max_token_len  # rows up to this long were warned of

    @property
    def size(self) -> int:
        return self.ranks.size

    def close(self) -> None:
        self.ranks.close()

    def lr_at(self, step: int) -> float:
        return lr_at(self.cfg, step)

    def _layout(self, lengths: list[int]) -> tuple[int, int | None]:
        """``layout`` for rows of these token ``lengths``. Fixed micro-batches are padded to
        their longest row: at most as many rows as the token bound holds at the longest
        length (one at least; two in bypass mode over several ranks, where a micro-batch of
        one padding row would be refused)."""
        if self.spec.use_dynamic_bsz:
            return layout(len(lengths), self.size, None)
        fit = max(1, self.max_token_len // max(lengths, default=1))
        if self.spec.bypass is not None and self.size > 1:
            fit = max(fit, 2)
        return layout(len(lengths), self.size, min(self.spec.micro_batch_size or fit, fit))

    def _warn_if_longer(self, lengths: list[int]) -> None:
        """A row longer than the token bound runs alone in its micro-batch, and its memory is
        bounded by nothing: said once, and again for a longer row."""
        longest = max(lengths, default=0)
        if longest <= self.longest_warned:
            return
        self.longest_warned = longest
        log.warning("a row of %d tokens is longer than the micro-batch bound of %d tokens "
                    "(%s): such rows run one to a micro-batch. To fit them, set "
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (tokens) or "
                    "actor_rollout_ref.actor.micro_batch_memory_gb (GB) higher if the memory "
                    "allows, or turn on actor_rollout_ref.actor.enable_gradient_checkpointing "
                    "(docs/gpu.md, Micro-batch memory)", longest, self.max_token_len,
                    _bound_origin(self.token_bound))

    def _max_tokens(self, lengths: list[int]) -> int:
        """The token bound each rank gets for verl's token-count cut: never below the
        longest row, which then runs alone in its micro-batch."""
        return max(self.max_token_len, max(lengths, default=1))

    def log_probs(self, vb: VerlBatch, ref: bool = False) -> torch.Tensor:
        """[B, R] log-probs of ``vb``'s response tokens under the engine's current weights
        (or the reference's), at each row's temperature."""
        lengths = _lengths(vb)
        total, micro = self._layout(lengths)
        padded = vb.padded_to(total)
        shards = _shards(padded, self.size, micro)
        parts = self.ranks.call("log_probs", [(padded.select(s),) for s in shards], ref=ref,
                                micro=micro, max_tokens=self._max_tokens(lengths))
        out = torch.zeros(len(padded), vb.responses.shape[1])
        for rows, part in zip(shards, parts, strict=True):
            out[rows] = part[:, : out.shape[1]]
        return out[: len(vb)]

    def probe_log_probs(self, ids: list[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` after ``ids[0]`` at temperature 1, through the engine's own
        forward: what the weight-sync probe expects an inference server to answer."""
        from workers.trainer.batch import Sample

        probe = to_verl_batch([Sample(ids[:1], ids[1:], [0.0] * (len(ids) - 1), 0.0, "probe",
                                      1.0, 0)], 0)
        return self.log_probs(probe)[0, probe.response_mask[0] > 0].tolist()

    def _mini_batches(self, vb: VerlBatch) -> list[list[int]]:
        groups = sorted(set(vb.group_ids[: vb.real]))
        per = int(self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size) or len(groups)
        out = []
        for start in range(0, len(groups), per):
            chosen = set(groups[start:start + per])
            out.append([i for i in range(vb.real) if vb.group_ids[i] in chosen])
        return out

    def _per_rank(self, vb: VerlBatch, rows: list[int], lengths: list[int],
                  fields: dict[str, torch.Tensor]
                  ) -> tuple[list[tuple[VerlBatch, dict[str, torch.Tensor]]], int | None]:
        """The mini-batch ``rows`` of ``vb`` (of token ``lengths``), padded to divide evenly,
        cut into one slice per rank with the matching slices of the per-token ``fields``;
        and the rows per micro-batch."""
        total, micro = self._layout(lengths)
        mb = vb.select(rows).padded_to(total)
        idx = torch.as_tensor(rows + [rows[0]] * (len(mb) - len(rows)))  # padding: any row
        mb_fields = {k: v[idx] for k, v in fields.items()}
        return [(mb.select(s), {k: v[s] for k, v in mb_fields.items()})
                for s in _shards(mb, self.size, micro)], micro

    def update(self, vb: VerlBatch, step: int = 0) -> dict[str, float]:
        lr = self.lr_at(step)
        trained, fields, rc_metrics = self._loss_inputs(vb)
        metrics, skipped = self._optimise(trained, fields, lr, step)
        self.skipped_steps += skipped
        out_metrics = {k: float(np.mean(v)) for k, v in metrics.items()}
        out_metrics.pop("grad_norm", None)
        out_metrics.update({k: float(v) for k, v in rc_metrics.items()})
        out_metrics["actor/lr"] = lr
        out_metrics["actor/skipped_steps"] = float(skipped)
        out_metrics["actor/skipped_steps_total"] = float(self.skipped_steps)
        out_metrics["actor/max_token_len_per_gpu"] = float(self.max_token_len)
        out_metrics.update(_batch_metrics(vb, fields["advantages"]))
        return out_metrics

    def _loss_inputs(self, vb: VerlBatch
                     ) -> tuple[VerlBatch, dict[str, torch.Tensor], dict[str, float]]:
        """The batch as trained (rollout correction's rejection applied to its mask), the
        fields verl's loss reads (old and reference log-probs, advantages, IS weights), and
        the correction's metrics."""
        actor, algo = self.cfg.actor_rollout_ref.actor, self.cfg.algorithm
        # bypass mode: the policy that sampled is the old policy (no forward for it); the
        # loss computes the correction and the rejection itself
        bypass = self.spec.bypass is not None
        old_log_prob = vb.rollout_log_probs if bypass else self.log_probs(vb)
        fields: dict[str, torch.Tensor] = {"old_log_probs": old_log_prob}
        if actor.use_kl_loss:
            fields["ref_log_prob"] = self.log_probs(vb, ref=True)
        mask = vb.response_mask
        fields["advantages"] = compute_advantages(
            algo.adv_estimator, vb.rewards, mask, vb.group_ids,
            bool(algo.norm_adv_by_std_in_grpo), vb.rollout_ids, vb.rowless)
        rc_metrics: dict[str, float] = {}
        if not bypass:
            is_weights, mask, rc_metrics = rollout_correction(
                old_log_prob, vb.rollout_log_probs, mask, algo.rollout_correction)
            if is_weights is not None:
                fields["rollout_is_weights"] = is_weights
            rc_metrics.update(constrained_is_metrics(is_weights, mask, vb.constrained))
        return replace(vb, response_mask=mask), fields, rc_metrics

    def _optimise(self, trained: VerlBatch, fields: dict[str, torch.Tensor], lr: float,
                  step: int) -> tuple[dict[str, list[float]], int]:
        """``ppo_epochs`` passes over the mini-batches, one optimizer step each, on the
        ranks; their metrics, and how many steps a non-finite gradient norm skipped."""
        # rows without a trained token (every call masked) add nothing to the loss, whose
        # normalisers are the token count and global_batch_size: not run
        has_tokens = (trained.response_mask.sum(1) > 0).tolist()
        all_lengths = _lengths(trained)
        self._warn_if_longer(all_lengths[: trained.real])
        metrics: dict[str, list[float]] = {}
        skipped = 0
        for _ in range(int(self.cfg.actor_rollout_ref.actor.ppo_epochs)):
            for rows in self._mini_batches(trained):
                live = [i for i in rows if has_tokens[i]] or rows
                lengths = [all_lengths[i] for i in live]
                per_rank, micro = self._per_rank(trained, live, lengths, fields)
                out = self.ranks.call("train", per_rank, lr=lr, global_batch_size=len(rows),
                                      micro=micro, max_tokens=self._max_tokens(lengths))[0]
                grad_norm = float(out.get("grad_norm", float("nan")))
                if not math.isfinite(grad_norm):
                    skipped += 1
                    log.warning("step %d: gradient norm %s is not finite; the optimizer step "
                                "was skipped (weights unchanged)", step, grad_norm)
                for k, v in out.items():
                    if k.startswith("perf/") or k in ("lr", "loss"):
                        continue
                    vals = v if isinstance(v, list) else [v]
                    metrics.setdefault(k, []).extend(float(x) for x in vals)
                metrics.setdefault("actor/grad_norm", []).append(grad_norm)
        return metrics, skipped

    def full_weights(self, dtype: str = "float32") -> dict[str, torch.Tensor]:
        """Every tensor of the model, gathered from the ranks (a collective)."""
        return self.ranks.call("export", [(None, dtype)] * self.size)[0]

    def export_weights(self, path: Path, dtype: str) -> None:
        """``path/model.safetensors`` in ``dtype`` from the engine's per-tensor iterator."""
        self.ranks.call("export", [(str(path), dtype)] * self.size)

    def export_adapter(self, path: Path, dtype: str) -> None:
        """``path``: the LoRA adapter alone, in peft's format (vLLM's ``load_lora_adapter``)."""
        self.ranks.call("export_adapter", [(str(path), dtype)] * self.size)

    def transfer_weights(self, urls: list[str], dtype: str, bucket_bytes: int,
                         timeout: float, api_key: str | None, engine: str = "shm"
                         ) -> TransferResult:
        """The weights, in ``dtype``, into every server in ``urls`` without an export
        (``inference.weight_sync: transfer``, with ``inference.transfer_engine``
        ``engine``); the caller names the version once each
        server's prefix cache is reset."""
        out = self.ranks.call("transfer", urls=urls, dtype=dtype, bucket_bytes=bucket_bytes,
                              timeout=timeout, api_key=api_key, engine=engine)[0]
        return TransferResult(**out)

    @property
    def exports_here(self) -> bool:
        """Rank 0, which writes the export, runs on this host."""
        return bool(getattr(self.ranks, "on_this_host", True))

    def parameter_count(self) -> int:
        """The model's parameters (a tied head counted once)."""
        return int(self.ranks.call("parameter_count")[0])

    def memory(self, stage: str) -> dict[str, float]:
        """Every rank's accelerator memory now, as metrics named for ``stage``."""
        return _memory_metrics(stage, self.ranks.call("memory"))

    def release_memory(self, stage: str, offload: bool) -> dict[str, float]:
        """Every rank gives its cached accelerator memory back (``offload``: and parks what
        ``fsdp_config`` offloads); returns when all have (the call is a barrier), with each
        rank's memory after, as metrics named for ``stage``."""
        return _memory_metrics(stage, self.ranks.call("release_memory", offload=offload))

    def save(self, path: Path) -> None:
        self.ranks.call("save", [(str(path),)] * self.size)

    def load(self, path: Path) -> None:
        self.ranks.call("load", [(str(path),)] * self.size)


def _batch_metrics(vb: VerlBatch, advantages: torch.Tensor) -> dict[str, float]:
    """What the batch held: rows, tokens, calls packed into rows, advantage size."""
    real = vb.response_mask[: vb.real]
    # A later turn re-sends the conversation; when its prompt begins with the tokens sampled
    # before, it joins their row (``batch.pack_turns``). Calls that could not (the chat
    # template re-rendered the earlier turn differently) each cost a row.
    calls = sum(vb.calls[: vb.real])
    ids = vb.rollout_ids[: vb.real]
    rollouts = len({r for r in ids if r}) + ids.count("")  # "" never shares a row
    return {
        "actor/advantage_abs_mean": float(
            (advantages[: vb.real].abs() * real).sum() / real.sum().clamp(min=1)),
        "batch/rows": float(vb.real),
        "batch/later_turn_calls": float(calls - rollouts),
        "batch/packed_calls": float(calls - vb.real),
        "actor/response_length_mean": float(real.sum() / max(calls, 1)),
        "batch/trained_tokens": float(real.sum()),
    }

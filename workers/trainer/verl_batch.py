"""Captured calls in verl's layout: the batch adapter between the collector and verl's engine.

One row per rollout segment (``batch.pack_turns``): the prompt is everything before the first
sampled token, the response everything after it. In a multi-turn row the response also holds
the tokens the agent added between calls (tool output, the next user turn); those carry
``response_mask`` 0, so they condition the later turns in the same forward pass but are never
trained on. This is verl's own multi-turn convention.

Invariants:
- ``response_mask`` is 1 exactly at the tokens the policy sampled (less those of a call
  masked out: ``algorithm.overlong.mask``); ``rollout_log_probs`` is the engine's log-prob
  at every sampled token and 0 elsewhere.
- Rows added by ``padded_to`` have an all-zero ``response_mask`` (and no reward): every loss and
  every token count verl computes ignores them, so padding a batch to divide evenly over
  ranks or micro-batches changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from workers.trainer.batch import Sample, pack_turns

if TYPE_CHECKING:
    from tensordict import TensorDict


@dataclass
class VerlBatch:
    prompts: torch.Tensor            # [B, P] long, left-padded
    responses: torch.Tensor          # [B, R] long, right-padded
    prompt_mask: torch.Tensor        # [B, P] 1 at real prompt tokens
    response_attention: torch.Tensor  # [B, R] 1 at real response tokens (trained or not)
    response_mask: torch.Tensor      # [B, R] float, 1 at sampled tokens
    rollout_log_probs: torch.Tensor  # [B, R] float
    temperatures: torch.Tensor       # [B] float
    rewards: torch.Tensor            # [B] float
    group_ids: list[str]
    rollout_ids: list[str]
    calls: list[int] = field(default_factory=list)
    real: int = -1                   # rows before padding (the rest are padding)
    # (group id, reward) of rollouts without a row: part of their group's baseline only
    rowless: list[tuple[str, float]] = field(default_factory=list)
    constrained: torch.Tensor | None = None  # [B, R] 1 at tokens sampled under a grammar mask

    def __post_init__(self) -> None:
        if self.real < 0:
            self.real = len(self.group_ids)

    def __len__(self) -> int:
        return len(self.group_ids)

    def select(self, rows: list[int]) -> VerlBatch:
        idx = torch.as_tensor(rows, dtype=torch.long)
        return VerlBatch(
            self.prompts[idx], self.responses[idx], self.prompt_mask[idx],
            self.response_attention[idx], self.response_mask[idx],
            self.rollout_log_probs[idx], self.temperatures[idx], self.rewards[idx],
            [self.group_ids[i] for i in rows], [self.rollout_ids[i] for i in rows],
            [self.calls[i] for i in rows], real=sum(1 for i in rows if i < self.real),
            rowless=self.rowless,
            constrained=None if self.constrained is None else self.constrained[idx])

    def padded_to(self, rows: int) -> VerlBatch:
        """This batch with all-masked rows appended up to ``rows`` rows."""
        extra = rows - len(self)
        if extra <= 0:
            return self
        # A padding row is row 0's last prompt token and first response token: a valid
        # sequence of two (the forward pass is well-defined, and a micro-batch of padding
        # rows costs next to nothing), with every loss mask at zero.
        pad = self.select([0] * extra)
        zero = torch.zeros_like(pad.response_mask)
        prompt_mask = torch.zeros_like(pad.prompt_mask)
        prompt_mask[:, -1] = 1
        attention = torch.zeros_like(pad.response_attention)
        attention[:, 0] = 1
        pad = replace(pad, prompt_mask=prompt_mask, response_attention=attention,
                      response_mask=zero, rollout_log_probs=zero.clone(),
                      rewards=torch.zeros_like(pad.rewards))
        cat = torch.cat
        return VerlBatch(
            cat([self.prompts, pad.prompts]), cat([self.responses, pad.responses]),
            cat([self.prompt_mask, pad.prompt_mask]),
            cat([self.response_attention, pad.response_attention]),
            cat([self.response_mask, pad.response_mask]),
            cat([self.rollout_log_probs, pad.rollout_log_probs]),
            cat([self.temperatures, pad.temperatures]), cat([self.rewards, pad.rewards]),
            self.group_ids + [""] * extra, self.rollout_ids + [""] * extra,
            self.calls + [0] * extra, real=self.real, rowless=self.rowless,
            constrained=None if self.constrained is None
            else cat([self.constrained, torch.zeros_like(pad.response_mask)]))

    def tensordict(self, **fields: torch.Tensor) -> TensorDict:
        """verl's no-padding TensorDict of these rows, with per-token ``fields`` ([B, R])
        such as ``old_log_probs``, ``advantages``, ``rollout_is_weights``, ``ref_log_prob``."""
        from tensordict import TensorDict
        from verl.workers.utils.padding import left_right_2_no_padding

        attention = torch.cat([self.prompt_mask, self.response_attention], dim=1)
        position_ids = (torch.cumsum(attention, dim=1) - 1).clamp(min=0)
        data = {
            "prompts": self.prompts, "responses": self.responses,
            "input_ids": torch.cat([self.prompts, self.responses], dim=1),
            "attention_mask": attention, "position_ids": position_ids,
            "response_mask": self.response_mask,
            "rollout_log_probs": self.rollout_log_probs,
            "temperature": self.temperatures,
            **fields,
        }
        td = TensorDict(data, batch_size=[len(self)])
        return left_right_2_no_padding(td)


def to_verl_batch(samples: list[Sample], pad_id: int,
                  rowless: list[tuple[str, float]] | None = None) -> VerlBatch:
    rows = pack_turns(samples)
    prompt_lens = [r.positions[0] for r in rows]
    resp_lens = [len(r.tokens) - p for r, p in zip(rows, prompt_lens, strict=True)]
    b, p_max, r_max = len(rows), max(prompt_lens), max(resp_lens)
    prompts = torch.full((b, p_max), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p_max), dtype=torch.long)
    responses = torch.full((b, r_max), pad_id, dtype=torch.long)
    resp_att = torch.zeros((b, r_max), dtype=torch.long)
    mask = torch.zeros((b, r_max), dtype=torch.float32)
    rollout_lp = torch.zeros((b, r_max), dtype=torch.float32)
    constrained = torch.zeros((b, r_max), dtype=torch.float32)
    for i, (row, p, r) in enumerate(zip(rows, prompt_lens, resp_lens, strict=True)):
        prompts[i, p_max - p:] = torch.tensor(row.tokens[:p])
        prompt_mask[i, p_max - p:] = 1
        responses[i, :r] = torch.tensor(row.tokens[p:])
        resp_att[i, :r] = 1
        at = torch.tensor(row.positions) - p
        mask[i, at] = torch.tensor(row.trained, dtype=torch.float32)
        constrained[i, at] = torch.tensor(row.constrained, dtype=torch.float32)
        rollout_lp[i, at] = torch.tensor(row.logprobs, dtype=torch.float32)
    return VerlBatch(
        prompts, responses, prompt_mask, resp_att, mask, rollout_lp,
        torch.tensor([r.first.temperature for r in rows], dtype=torch.float32),
        torch.tensor([r.first.reward for r in rows], dtype=torch.float32),
        [r.first.group_id for r in rows], [r.first.rollout_id for r in rows],
        [r.calls for r in rows], rowless=list(rowless or []), constrained=constrained)

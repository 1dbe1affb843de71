"""From selected groups to padded tensors.

Every captured model call of a rollout is one sample; all samples of a rollout share its
reward, all samples of a group share the group id (the GRPO/RLOO index). Samples whose
capture is unusable (missing or non-finite log-probs, empty response, lengths that do not
line up) are excluded and counted, never trained.

A multi-turn rollout's later call usually re-sends the whole conversation: its prompt begins
with the earlier call's prompt and response. Such calls share one row of the batch (one
forward pass computes the logits of every response in it, each with exactly the causal
context it was sampled with), which halves the tokens a two-turn agent costs the update.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from app.config.schema import Config
from app.state import keys
from app.state.completion import sibling_results
from app.state.records import CapturedCall, RolloutRecord

if TYPE_CHECKING:  # torch is imported where a batch is built, not with this module
    from torch import Tensor

log = logging.getLogger(__name__)


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    group_id: str
    temperature: float
    policy_version: int
    rollout_id: str = ""   # consecutive calls of one rollout may share a row; "" never does
    trained: bool = True   # False: in its row as context only (an over-long call masked out)
    finish_reason: str | None = None
    constrained: bool = False  # sampled under a grammar mask (CapturedCall.constrained)


@dataclass
class BatchStats:
    groups: int = 0
    rollouts: int = 0
    samples: int = 0
    excluded_samples: int = 0
    failed_rollouts_zero_reward: int = 0
    rewards: list[float] = field(default_factory=list)   # one per rollout
    # one per sample: the version at the call's start (a call frozen across an update is
    # as old as its oldest tokens)
    versions: list[int] = field(default_factory=list)
    mixed_version_samples: int = 0   # calls that spanned a weight update (drain_mode keep)
    mixed_version_tokens: int = 0    # their response tokens sampled after the first switch
    # (group id, reward) of each rollout that left no trainable call: still in its group's
    # baseline (``algorithms.compute_advantages``)
    rowless: list[tuple[str, float]] = field(default_factory=list)
    small_groups: int = 0            # groups left with too few rewards to train on
    constrained_calls: int = 0       # trainable calls sampled under a grammar mask
    continued_calls: int = 0         # trainable calls whose prompt continued a kept turn
    overlong_calls: int = 0          # trainable calls cut at max_tokens (finish_reason length)
    overlong_masked_calls: int = 0   # of those, left out of the loss (algorithm.overlong.mask)
    penalties: list[float] = field(default_factory=list)  # soft over-long penalty per rollout


@dataclass(frozen=True)
class Overlong:
    """``algorithm.overlong``: what happens to calls cut at ``max_tokens``."""

    mask: bool = False              # DAPO's over-long filtering: their tokens train nothing
    buffer_len: int = 0             # DAPO's soft over-long penalty (0: off)
    penalty_factor: float = 1.0
    max_response_length: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Overlong:
        o = cfg.algorithm.overlong
        return cls(o.mask, o.buffer_len, o.penalty_factor, o.max_response_length or 0)

    def penalty(self, response_len: int) -> float:
        """DAPO's soft penalty: 0 up to ``max_response_length - buffer_len`` tokens, then
        falling linearly to ``-penalty_factor`` at ``max_response_length`` (and beyond)."""
        if self.buffer_len <= 0:
            return 0.0
        exceed = response_len - (self.max_response_length - self.buffer_len)
        return max(min(-exceed / self.buffer_len * self.penalty_factor, 0.0),
                   -self.penalty_factor)


def collect_samples(client: redis.Redis, group_ids: list[str], zero_reward_failures: bool,
                    min_group_rewards: int = 1, overlong: Overlong = Overlong()
                    ) -> tuple[list[Sample], BatchStats]:
    """The trainable calls of ``group_ids``. A group with fewer than ``min_group_rewards``
    rewards (2 for a group-relative estimator: one reward has no baseline) is left out.
    The soft over-long penalty of a rollout is that of its longest call, added to its
    reward (what its group's baseline sees too); ``stats.rewards`` keep the raw rewards."""
    stats = BatchStats(groups=len(group_ids))
    samples: list[Sample] = []
    for gid in group_ids:
        group_samples: list[Sample] = []
        group_rowless: list[tuple[str, float]] = []
        rewards = 0
        for _, result in sorted(sibling_results(client, gid).items()):  # sibling order
            if result.status == "ok":
                reward = float(result.reward)  # type: ignore[arg-type]
            elif zero_reward_failures:
                reward = 0.0
                stats.failed_rollouts_zero_reward += 1
            else:
                continue
            stats.rollouts += 1
            stats.rewards.append(reward)
            rewards += 1
            calls = _rollout_samples(client, result.rollout_id, gid, reward, stats)
            reward = _shape_overlong(calls, reward, overlong, stats)
            if any(c.trained for c in calls):
                group_samples += calls
            else:  # nothing of it trains: it stays in the baseline only
                group_rowless.append((gid, reward))
        if rewards < min_group_rewards:
            stats.small_groups += 1
            log.warning("group %s not trained: %d reward(s), a group-relative baseline needs "
                        "%d", gid, rewards, min_group_rewards)
            continue
        samples += group_samples
        stats.rowless += group_rowless
        for s in group_samples:
            stats.versions.append(s.policy_version)
    stats.samples = len(samples)
    return samples, stats


def _shape_overlong(calls: list[Sample], reward: float, overlong: Overlong,
                    stats: BatchStats) -> float:
    """Count a rollout's calls cut at ``max_tokens``, mask them out when configured, and add
    the soft penalty of its longest call to its reward; returns the reward its samples (and
    its group's baseline) use."""
    if overlong.buffer_len and calls:
        penalty = overlong.penalty(max(len(c.response_ids) for c in calls))
        stats.penalties.append(penalty)
        reward += penalty
    for c in calls:
        c.reward = reward
        if c.finish_reason == "length":
            stats.overlong_calls += 1
            if overlong.mask:
                c.trained = False
                stats.overlong_masked_calls += 1
    return reward


def _rollout_samples(client: redis.Redis, rollout_id: str | None, gid: str, reward: float,
                     stats: BatchStats) -> list[Sample]:
    """A rollout's usable calls as samples; the unusable ones are counted in ``stats``."""
    if not rollout_id:
        return []
    if client.hget(keys.rollout(rollout_id), RolloutRecord.field("calls_lost")) == "1":
        # a Redis crash lost calls its agent saw: what is left would train on a trajectory
        # its reward does not describe
        stats.excluded_samples += max(client.llen(keys.rollout_calls(rollout_id)), 1)
        return []
    out = []
    for raw in client.lrange(keys.rollout_calls(rollout_id), 0, -1):
        call = CapturedCall.from_json(raw)
        usable = (call.response_ids and call.nonfinite_logprobs == 0
                  and len(call.logprobs) == len(call.response_ids) and call.prompt_ids)
        if not usable:
            stats.excluded_samples += 1
            continue
        out.append(Sample(call.prompt_ids, call.response_ids,
                          [float(x) for x in call.logprobs],  # type: ignore[arg-type]
                          reward, gid, call.temperature, call.policy_version, rollout_id,
                          finish_reason=call.finish_reason,
                          constrained=call.constrained is not None))
        stats.constrained_calls += call.constrained is not None
        stats.continued_calls += call.continued
        if call.spans_update:
            stats.mixed_version_samples += 1
            after = call.tokens_after_switch()
            # not streamed: where the switch fell is unknown, count the whole call
            stats.mixed_version_tokens += len(call.response_ids) if after is None else after
    return out


@dataclass
class Batch:
    input_ids: Tensor         # [B, L] long
    attention_mask: Tensor    # [B, L]
    response_index: Tensor    # [B, R] positions whose logits predict response token j
    response_ids: Tensor      # [B, R] long
    response_mask: Tensor     # [B, R] float
    rollout_log_probs: Tensor  # [B, R] float
    rewards: Tensor           # [B] float
    temperatures: Tensor      # [B, 1] float
    group_ids: list[str]
    calls: list[int] = field(default_factory=list)  # samples (model calls) in each row
    rollout_ids: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.group_ids)

    def select(self, rows: list[int]) -> Batch:
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.response_index[idx],
                     self.response_ids[idx], self.response_mask[idx],
                     self.rollout_log_probs[idx], self.rewards[idx], self.temperatures[idx],
                     [self.group_ids[i] for i in rows], [self.calls[i] for i in rows],
                     [self.rollout_ids[i] for i in rows])


@dataclass
class Row:
    """One batch row: a token sequence and the positions of the response tokens in it."""

    tokens: list[int]
    positions: list[int]      # index in ``tokens`` of each response token
    response_ids: list[int]
    logprobs: list[float]
    first: Sample             # reward, group and temperature (shared by the row's calls)
    calls: int = 1
    trained: list[bool] = field(default_factory=list)  # per response token: in the loss
    constrained: list[bool] = field(default_factory=list)  # per response token: under a mask

    def __post_init__(self) -> None:
        if not self.trained:
            self.trained = [self.first.trained] * len(self.response_ids)
        if not self.constrained:
            self.constrained = [self.first.constrained] * len(self.response_ids)


def pack_turns(samples: list[Sample]) -> list[Row]:
    """Rows of ``samples``; a call joins the previous call's row when both belong to the same
    rollout, use the same temperature and the call's prompt begins with the row's tokens."""
    rows: list[Row] = []
    for s in samples:
        last = rows[-1] if rows else None
        n = len(last.tokens) if last else 0
        if (last is not None and s.rollout_id and s.rollout_id == last.first.rollout_id
                and s.temperature == last.first.temperature
                and len(s.prompt_ids) >= n and s.prompt_ids[:n] == last.tokens):
            start = len(s.prompt_ids)
            last.tokens = s.prompt_ids + s.response_ids
            last.positions += range(start, start + len(s.response_ids))
            last.response_ids += s.response_ids
            last.logprobs += s.rollout_logprobs
            last.trained += [s.trained] * len(s.response_ids)
            last.constrained += [s.constrained] * len(s.response_ids)
            last.calls += 1
            continue
        p = len(s.prompt_ids)
        rows.append(Row(s.prompt_ids + s.response_ids, list(range(p, p + len(s.response_ids))),
                        list(s.response_ids), list(s.rollout_logprobs), s))
    return rows


def to_batch(samples: list[Sample], pad_id: int, device: str = "cpu") -> Batch:
    """Right-padded rows (see ``pack_turns``); response tokens gathered into [B, R]."""
    import torch

    rows = pack_turns(samples)
    seq_len = max(len(r.tokens) for r in rows)
    resp_len = max(len(r.response_ids) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, seq_len), dtype=torch.long)
    response_index = torch.zeros((b, resp_len), dtype=torch.long)
    response_ids = torch.full((b, resp_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, resp_len), dtype=torch.float32)
    rollout_lp = torch.zeros((b, resp_len), dtype=torch.float32)
    for i, row in enumerate(rows):
        t, r = len(row.tokens), len(row.response_ids)
        input_ids[i, :t] = torch.tensor(row.tokens)
        attention[i, :t] = 1
        # the logits at position t predict token t+1
        response_index[i, :r] = torch.tensor(row.positions) - 1
        response_ids[i, :r] = torch.tensor(row.response_ids)
        response_mask[i, :r] = torch.tensor(row.trained, dtype=torch.float32)
        rollout_lp[i, :r] = torch.tensor(row.logprobs)
    return Batch(
        input_ids.to(device), attention.to(device), response_index.to(device),
        response_ids.to(device), response_mask.to(device), rollout_lp.to(device),
        torch.tensor([r.first.reward for r in rows], dtype=torch.float32, device=device),
        torch.tensor([[r.first.temperature] for r in rows], dtype=torch.float32,
                     device=device),
        [r.first.group_id for r in rows], [r.calls for r in rows],
        [r.first.rollout_id for r in rows])

"""From selected groups to padded tensors.

Every captured model call of a rollout is one sample; all samples of a rollout share its
reward, all samples of a group share the group id (the GRPO/RLOO index). Samples whose
capture is unusable (missing or non-finite log-probs, empty response, lengths that do not
line up) are excluded and counted, never trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from app.state import keys
from app.state.records import CapturedCall
from workers.rollout.completion import sibling_results


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    group_id: str
    temperature: float
    policy_version: int


@dataclass
class BatchStats:
    groups: int = 0
    rollouts: int = 0
    samples: int = 0
    excluded_samples: int = 0
    failed_rollouts_zero_reward: int = 0
    rewards: list[float] = field(default_factory=list)   # one per rollout
    versions: list[int] = field(default_factory=list)    # one per sample


def collect_samples(client: redis.Redis, group_ids: list[str], zero_reward_failures: bool
                    ) -> tuple[list[Sample], BatchStats]:
    stats = BatchStats(groups=len(group_ids))
    samples: list[Sample] = []
    for gid in group_ids:
        for result in sibling_results(client, gid).values():
            if result.status == "ok":
                reward = float(result.reward)  # type: ignore[arg-type]
            elif zero_reward_failures:
                reward = 0.0
                stats.failed_rollouts_zero_reward += 1
            else:
                continue
            stats.rollouts += 1
            stats.rewards.append(reward)
            if not result.rollout_id:
                continue
            for raw in client.lrange(keys.rollout_calls(result.rollout_id), 0, -1):
                call = CapturedCall.from_json(raw)
                usable = (call.response_ids and call.nonfinite_logprobs == 0
                          and len(call.logprobs) == len(call.response_ids) and call.prompt_ids)
                if not usable:
                    stats.excluded_samples += 1
                    continue
                samples.append(Sample(call.prompt_ids, call.response_ids,
                                      [float(x) for x in call.logprobs],  # type: ignore[arg-type]
                                      reward, gid, call.temperature, call.policy_version))
                stats.versions.append(call.policy_version)
    stats.samples = len(samples)
    return samples, stats


@dataclass
class Batch:
    input_ids: object        # [B, L] long
    attention_mask: object   # [B, L]
    response_index: object   # [B, R] positions whose logits predict response token j
    response_ids: object     # [B, R] long
    response_mask: object    # [B, R] float
    rollout_log_probs: object  # [B, R] float
    rewards: object          # [B] float
    temperatures: object     # [B, 1] float
    group_ids: list[str]

    def __len__(self) -> int:
        return len(self.group_ids)

    def select(self, rows: list[int]) -> Batch:
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.response_index[idx],
                     self.response_ids[idx], self.response_mask[idx],
                     self.rollout_log_probs[idx], self.rewards[idx], self.temperatures[idx],
                     [self.group_ids[i] for i in rows])


def to_batch(samples: list[Sample], pad_id: int, device: str = "cpu") -> Batch:
    """Right-padded ``prompt + response`` rows; response tokens gathered into [B, R]."""
    import torch

    seq_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp_len = max(len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, seq_len), dtype=torch.long)
    response_index = torch.zeros((b, resp_len), dtype=torch.long)
    response_ids = torch.full((b, resp_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, resp_len), dtype=torch.float32)
    rollout_lp = torch.zeros((b, resp_len), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention[i, :p + r] = 1
        # the logits at position t predict token t+1
        response_index[i, :r] = torch.arange(p - 1, p + r - 1)
        response_ids[i, :r] = torch.tensor(s.response_ids)
        response_mask[i, :r] = 1.0
        rollout_lp[i, :r] = torch.tensor(s.rollout_logprobs)
    return Batch(
        input_ids.to(device), attention.to(device), response_index.to(device),
        response_ids.to(device), response_mask.to(device), rollout_lp.to(device),
        torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device),
        torch.tensor([[s.temperature] for s in samples], dtype=torch.float32, device=device),
        [s.group_id for s in samples])

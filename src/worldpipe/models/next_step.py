"""Next-step prediction over tokens: the loss shared by the sequence models (transformer, linear SSM).

Token t carries (o_t, a_t); the model's output at token t predicts the change o_{t+1} - o_t and the reward
r_t that a_t earned. Both terms count where step t+1 is valid. A model running on one chunk of a sequence
split in time gets the first step after its chunk from the next rank (``TimePartition.next_first``).
"""

from __future__ import annotations

import torch
from torch import nn

from worldpipe.parallel.time_partition import TimePartition

Tensor = torch.Tensor
LOSS_TERMS = ("total", "recon", "reward")


def next_step_targets(obs: Tensor, mask: Tensor, partition: TimePartition | None) -> tuple[Tensor, Tensor]:
    """obs_{t+1} [B,T,O] and mask_{t+1} [B,T] for every token of this chunk (mask 0 past the sequence end)."""
    if partition is not None and partition.is_split:
        next_obs = partition.next_first(obs[:, 0])
        next_mask = partition.next_first(mask[:, 0])
    else:
        next_obs, next_mask = torch.zeros_like(obs[:, 0]), torch.zeros_like(mask[:, 0])
    return (torch.cat([obs[:, 1:], next_obs.unsqueeze(1)], dim=1),
            torch.cat([mask[:, 1:], next_mask.unsqueeze(1)], dim=1))


def next_step_loss(output: Tensor, obs: Tensor, reward: Tensor, mask: Tensor,
                   partition: TimePartition | None, reward_scale: float) -> dict[str, Tensor]:
    """Per-term loss sums of head outputs [B,T,O+1] (observation change, reward) over this chunk's tokens."""
    target_obs, target_mask = next_step_targets(obs, mask, partition)
    delta, reward_pred = output[..., :-1], output[..., -1]
    recon = 0.5 * (obs + delta - target_obs).pow(2).sum(-1)
    reward_err = 0.5 * (reward_pred - reward).pow(2)
    sums = {"recon": (recon * target_mask).sum(), "reward": (reward_err * target_mask).sum()}
    sums["total"] = sums["recon"] + reward_scale * sums["reward"]
    return sums


class TokenEmbedding(nn.Module):
    """[o_t, a_t] -> a width-sized token."""

    def __init__(self, obs_dim: int, act_dim: int, width: int):
        super().__init__()
        self.proj = nn.Linear(obs_dim + act_dim, width)

    def forward(self, obs: Tensor, action: Tensor) -> Tensor:
        """obs [...,O], action [...,A] -> [...,W]."""
        return self.proj(torch.cat([obs, action], dim=-1))


def split_prediction(last_obs: Tensor, output: Tensor) -> tuple[Tensor, Tensor]:
    """Predicted next observation and reward from the last observation [B,O] and a head output [B,O+1]."""
    return last_obs + output[..., :-1], output[..., -1]

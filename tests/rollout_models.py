"""A tiny KV-cache world model for tests: its rollout state grows by one key per step, like a transformer's."""

from __future__ import annotations

import torch
from torch import nn

from worldpipe.models import WorldModel


class TinyKV(WorldModel):
    """Causal attention over a cache of keys; each imagined step appends one key (state_grows)."""

    state_grows = True

    def __init__(self, obs_dim: int, act_dim: int, width: int = 8) -> None:
        super().__init__(obs_dim, act_dim)
        self.encode = nn.Linear(obs_dim + act_dim, width)
        self.query = nn.Linear(width + act_dim, width)
        self.decode = nn.Linear(width, obs_dim + 1)

    def rollout_noise_shape(self) -> tuple[int, ...]:
        return (self.encode.out_features,)

    def observe_context(self, obs, action):
        shifted = torch.cat([action.new_zeros(action.shape[0], 1, action.shape[2]), action[:, :-1]], dim=1)
        return {"keys": torch.tanh(self.encode(torch.cat([obs, shifted], dim=-1)))}

    def imagine_step(self, state, action, noise=None):
        keys = state["keys"]  # [B, T, W]
        q = self.query(torch.cat([keys[:, -1], action], dim=-1))
        weights = torch.softmax((keys @ q.unsqueeze(-1)).squeeze(-1), dim=-1)
        attended = (weights.unsqueeze(-1) * keys).sum(1)
        if noise is not None:
            attended = attended + 0.1 * noise
        out = self.decode(attended)
        new_key = torch.tanh(attended).unsqueeze(1)
        return out[:, :-1], out[:, -1], {"keys": torch.cat([keys, new_key], dim=1)}


class BatchCoupled(TinyKV):
    """TinyKV whose step adds a trace of the batch mean: a row's bits depend on its neighbours by construction."""

    def imagine_step(self, state, action, noise=None):
        out, reward, new_state = super().imagine_step(state, action, noise)
        return out + 1e-3 * out.mean(0, keepdim=True), reward, new_state

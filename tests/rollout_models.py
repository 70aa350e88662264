"""Tiny world models for rollout tests: a KV cache (its state grows by one key per step, like a transformer's),
one whose rows cannot depend on their batch (element-wise sums and products only), one whose rows always do."""

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


class ElementwiseRecurrent(WorldModel):
    """A leaky sum of observations and actions, with element-wise additions and multiplications only.

    Each of those rounds once per element, identically in a vector lane and in scalar code, and mixes no rows, so
    a row's bits cannot depend on its batch on any machine (unlike a BLAS product, whose kernel and register
    blocking depend on the shape and on a row's place in it).
    """

    def __init__(self, obs_dim: int, act_dim: int) -> None:
        super().__init__(obs_dim, act_dim)
        self.decay = nn.Parameter(torch.rand(obs_dim) * 0.5 + 0.25)
        self.gain = nn.Parameter(torch.randn(obs_dim))

    def rollout_noise_shape(self) -> tuple[int, ...]:
        return (self.obs_dim,)

    def observe_context(self, obs, action):
        h = obs.new_zeros(obs.shape[0], self.obs_dim)
        for t in range(obs.shape[1]):
            h = h * self.decay + obs[:, t] + action[:, t, :1] * self.gain
        return {"h": h}

    def imagine_step(self, state, action, noise=None):
        h = state["h"] * self.decay + action[:, :1] * self.gain
        if noise is not None:
            h = h + noise * 0.1
        return h, h[:, 0] * h[:, -1], {"h": h}

"""A linear (affine) state-space world model: per layer h_t = a_t * h_{t-1} + b_t, run as a parallel scan.

Token t = Linear([o_t, a_t]). Each layer normalizes its input u_t, derives an input-dependent diagonal decay
a_t = sigmoid(W_a u_t) in (0, 1) and an input b_t = (1 - a_t) * W_b u_t, runs the recurrence over time, and adds
W_o h_t back to the residual stream, followed by an MLP. The recurrence is affine in h, so it is an
associative scan (parallel/scan.py): the sequence can be cut in time, every rank scanning its chunk and
receiving its boundary state from the chunk summaries of the ranks before it. The nonlinearity sits between
layers, never inside the recurrence, which is what keeps the cut exact (unlike the RSSM's GRU).

The head at token t predicts o_{t+1} - o_t and r_t (models/next_step.py). The rollout state is one [B, D]
vector per layer plus the last observation: a fixed size, whatever the horizon.
"""

from __future__ import annotations

import torch
from torch import nn

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel
from worldpipe.models.next_step import LOSS_TERMS, TokenEmbedding, next_step_loss, split_prediction
from worldpipe.parallel.scan import linear_recurrence
from worldpipe.parallel.time_partition import TimePartition

Tensor = torch.Tensor


class LinearRecurrenceLayer(nn.Module):
    """One gated diagonal affine recurrence with a residual MLP."""

    def __init__(self, width: int, state: int):
        super().__init__()
        self.norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.decay, self.inp, self.out = nn.Linear(width, state), nn.Linear(width, state), nn.Linear(state, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def coefficients(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(a_t, b_t) [..., D] of the recurrence for inputs x [..., W]."""
        u = self.norm(x)
        a = torch.sigmoid(self.decay(u))
        return a, (1.0 - a) * self.inp(u)

    def finish(self, x: Tensor, h: Tensor) -> Tensor:
        """Residual update of the stream x by the states h."""
        x = x + self.out(h)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: Tensor, partition: TimePartition | None = None) -> tuple[Tensor, Tensor]:
        """x [B,T,W] -> (new x [B,T,W], states h [B,T,D]); across ranks when ``partition`` is split."""
        a, b = self.coefficients(x)
        group = partition.group if partition is not None and partition.is_split else None
        h = linear_recurrence(a, b, group=group)
        return self.finish(x, h), h


class LinearSSM(WorldModel):
    """Stacked diagonal linear recurrences over (observation, action) tokens; deterministic head."""

    loss_terms = LOSS_TERMS
    parallel = ParallelSupport(batch=True, tensor_parallel=False, time_partition="scan")
    dimensions = ("width", "state", "layers")

    def __init__(self, obs_dim: int, act_dim: int, width: int = 64, state: int = 64, layers: int = 2,
                 reward_scale: float = 1.0):
        super().__init__(obs_dim, act_dim)
        self.reward_scale = reward_scale
        self.embed = TokenEmbedding(obs_dim, act_dim, width)
        self.layers = nn.ModuleList(LinearRecurrenceLayer(width, state) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, obs_dim + 1)
        self.state_size = state
        self.partition: TimePartition | None = None

    def bind_time_partition(self, partition: TimePartition) -> None:
        """Run ``forward`` on this rank's chunk of time; boundary states come from the earlier ranks."""
        self.partition = partition

    def _run(self, x: Tensor, partition: TimePartition | None = None) -> tuple[Tensor, list[Tensor]]:
        states = []
        for layer in self.layers:
            x, h = layer(x, partition)
            states.append(h)
        return self.head(self.norm(x)), states

    def forward(self, obs, action, reward, mask, noise) -> dict[str, Tensor]:
        """Per-term loss sums over this rank's windows (or its time chunk of them); ``noise`` is unused."""
        output, _ = self._run(self.embed(obs, action), self.partition)
        return next_step_loss(output, obs, reward, mask, self.partition, self.reward_scale)

    def observe_context(self, obs: Tensor, action: Tensor) -> RolloutState:
        """Each layer's state after tokens 0..C-2, and the last observation o_{C-1}."""
        state = {"last_obs": obs[:, -1]}
        if obs.shape[1] > 1:
            _, states = self._run(self.embed(obs[:, :-1], action[:, :-1]))
            for index, h in enumerate(states):
                state[f"h{index}"] = h[:, -1]
        else:
            for index in range(len(self.layers)):
                state[f"h{index}"] = obs.new_zeros(obs.shape[0], self.state_size)
        return state

    def imagine_step(self, state: RolloutState, action: Tensor,
                     noise: Tensor | None = None) -> tuple[Tensor, Tensor, RolloutState]:
        """One step of every layer's recurrence from the token (last observation, action)."""
        x = self.embed(state["last_obs"], action)
        new_state = {}
        for index, layer in enumerate(self.layers):
            a, b = layer.coefficients(x)
            h = a * state[f"h{index}"] + b
            x = layer.finish(x, h)
            new_state[f"h{index}"] = h
        obs_pred, reward_pred = split_prediction(state["last_obs"], self.head(self.norm(x)))
        new_state["last_obs"] = obs_pred
        return obs_pred, reward_pred, new_state

"""A deterministic recurrent dynamics model: no latent variables, no noise.

After reading (o_t, a_t) the GRU state h_{t+1} predicts the next observation as a residual and the reward of
that transition. Shapes: B windows, T steps, O/A observation/action size, D state size.

    h_0 = 0        h_{t+1} = GRU(h_t, enc([o_t, a_t]))        ô_{t+1} = o_t + dec(h_{t+1})        r̂_t = rew(h_{t+1})

Imagination feeds its own predictions back as the next input. Like the RSSM it is a nonlinear recurrence, so it
partitions over the batch only.

Trained one step ahead (teacher forcing), a planner's imagined rollouts drift: each step reads a prediction the
model never saw as input. ``rollout_steps`` = k > 1 also trains it on its own predictions: from every teacher-forced
state the model runs k - 1 more steps open loop on the data's actions, and each depth's observation and reward
errors join the loss, averaged over the k depths (PlaNet's overshooting, on observations; TD-MPC's multi-step
consistency). k = 1 is teacher forcing alone.
"""

from __future__ import annotations

import torch
from torch import nn

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel, has_dtensor_parameters


def _mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.ELU(), nn.Linear(hidden, out))


class GRUDynamics(WorldModel):
    """Deterministic GRU world model over vector observations."""

    loss_terms = ("total", "recon", "reward")
    parallel = ParallelSupport(batch=True, tensor_parallel=False, time_partition=None)
    dimensions = ("embed", "deter", "hidden", "rollout_steps")

    def __init__(self, obs_dim: int, act_dim: int, embed: int = 64, deter: int = 64, hidden: int = 128,
                 reward_scale: float = 1.0, rollout_steps: int = 1):
        super().__init__(obs_dim, act_dim)
        self.deter = deter
        self.reward_scale = reward_scale
        self.rollout_steps = rollout_steps
        self.encoder = _mlp(obs_dim + act_dim, hidden, embed)
        self.cell = nn.GRUCell(embed, deter)
        self.decoder = _mlp(deter, hidden, obs_dim)
        self.reward_head = _mlp(deter, hidden, 1)

    def _advance(self, h: torch.Tensor, obs: torch.Tensor, action: torch.Tensor):
        """One transition from (h_t, o_t, a_t): h_{t+1}, predicted o_{t+1} [B,O] and r_t [B]."""
        h = self.cell(self.encoder(torch.cat([obs, action], dim=-1)), h)
        return h, obs + self.decoder(h), self.reward_head(h).squeeze(-1)

    def _states(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """h_1..h_{T-1} [B,T-1,D] from teacher-forced inputs (o_t, a_t), t < T-1, and h_0 = 0.

        Only the GRU steps through time: the encoder runs once over all steps, then torch's sequence GRU (its
        loop in C++, the input projection batched over all steps) with the cell's own weights. Under
        torch.compile, or with parameters sharded outside their module's forward (FSDP2), the cell steps in Python.
        """
        inputs = self.encoder(torch.cat([obs[:, :-1], action[:, :-1]], dim=-1))  # [B,T-1,E]
        h = obs.new_zeros(obs.shape[0], self.deter)
        if inputs.shape[1] == 0:
            return inputs.new_zeros(obs.shape[0], 0, self.deter)
        cell = self.cell
        if torch.compiler.is_compiling() or has_dtensor_parameters(cell):
            states = []
            for t in range(inputs.shape[1]):
                h = cell(inputs[:, t], h)
                states.append(h)
            return torch.stack(states, dim=1)
        weights = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        states, _ = torch.gru(inputs, h.unsqueeze(0), weights, True, 1, 0.0, self.training, False, True)
        return states

    def forward(self, obs, action, reward, mask, noise=None) -> dict[str, torch.Tensor]:
        """Per-term loss sums over valid transitions (teacher forcing). obs [B,T,O], action [B,T,A], reward/mask [B,T]."""
        h = self._states(obs, action)  # [B,T-1,D]: the state after transition t -> t+1
        valid = mask[:, 1:]  # a transition t -> t+1 counts when step t+1 is a real step
        recon = 0.5 * (obs[:, :-1] + self.decoder(h) - obs[:, 1:]).pow(2).sum(-1)  # [B,T-1]
        reward_err = 0.5 * (self.reward_head(h).squeeze(-1) - reward[:, :-1]).pow(2)  # [B,T-1]
        sums = {"recon": (recon * valid).sum(), "reward": (reward_err * valid).sum()}
        if self.rollout_steps > 1:
            sums = self._with_open_loop_depths(sums, h, obs, action, reward, mask)
        sums["total"] = sums["recon"] + self.reward_scale * sums["reward"]
        return sums

    def _with_open_loop_depths(self, sums: dict[str, torch.Tensor], h: torch.Tensor, obs: torch.Tensor,
                               action: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss sums averaged over depths 0..k-1: depth j starts from each teacher-forced state h_{t+1} and
        steps j more times on its own predictions and the data's actions a_{t+1..t+j}; it predicts o_{t+j+1}
        and r_{t+j}, counted where step t+j+1 is real."""
        recon_total, reward_total = sums["recon"], sums["reward"]
        batch, deter = h.shape[0], self.deter
        predicted = obs[:, :-1] + self.decoder(h)  # [B,T-1,O]: depth 0's prediction of o_{t+1}
        depths = max(1, min(self.rollout_steps, obs.shape[1] - 1))
        for depth in range(1, depths):
            starts = obs.shape[1] - 1 - depth  # start steps t whose depth-th prediction stays inside the window
            h_in, obs_in = h[:, :starts].reshape(-1, deter), predicted[:, :starts]
            inputs = self.encoder(torch.cat([obs_in, action[:, depth:depth + starts]], dim=-1))
            h = self.cell(inputs.reshape(-1, inputs.shape[-1]), h_in).reshape(batch, starts, deter)
            predicted = obs_in + self.decoder(h)
            valid = mask[:, depth + 1:]
            recon_total = recon_total + (0.5 * (predicted - obs[:, depth + 1:]).pow(2).sum(-1) * valid).sum()
            reward_err = 0.5 * (self.reward_head(h).squeeze(-1) - reward[:, depth:depth + starts]).pow(2)
            reward_total = reward_total + (reward_err * valid).sum()
        return {"recon": recon_total / depths, "reward": reward_total / depths}

    def observe_context(self, obs: torch.Tensor, action: torch.Tensor) -> RolloutState:
        """Read the history; the state holds h and the last observation (the next step's input)."""
        states = self._states(obs, action)
        h = states[:, -1] if states.shape[1] else obs.new_zeros(obs.shape[0], self.deter)
        return {"h": h, "obs": obs[:, -1]}

    def imagine_step(self, state: RolloutState, action: torch.Tensor,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RolloutState]:
        """Predict the next observation and reward; the prediction becomes the next input (noise is unused)."""
        h, next_obs, reward = self._advance(state["h"], state["obs"], action)
        return next_obs, reward, {"h": h, "obs": next_obs}

"""What a planner imagines with: a learned world model, or the true simulator (the ceiling it is compared with).

Both answer the same two questions, so a planner never knows which one it drives:

* :meth:`observe` — the real history so far (raw observations [T,O], actions [T-1,A]) sets the state that
  imagined trajectories start from;
* :meth:`imagine` — rewards [N,H] of N action sequences [N,H,A] from that state.

A learned model filters the last ``context`` steps of the history (the window it was evaluated with), then
imagines all N sequences in one batch through :func:`worldpipe.rollout.engine.imagine_sequences`. Imagination
takes the model's means (no sampled latents), so a decision is a function of the history and the planner's own
noise only.
"""

from __future__ import annotations

import math

import torch

from worldpipe.core.errors import UserError
from worldpipe.models import RolloutState, WorldModel
from worldpipe.rollout.engine import imagine_sequences


class ControlError(UserError):
    """A closed-loop evaluation that cannot run as configured (one line, no traceback)."""


class LearnedDynamics:
    """A trained world model as the planner's simulator."""

    def __init__(self, model: WorldModel, context: int) -> None:
        if context < 1:
            raise ControlError(f"control context must be >= 1 step, got {context}")
        self.model, self.context = model, int(context)
        self.state: RolloutState | None = None

    @torch.no_grad()
    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Filter the last ``context`` observations of obs [T,O] (raw) with the actions between them [T-1,A]."""
        window = obs[-self.context:]
        steps = window.shape[0]
        # observe_context reads actions[:C-1]; the last row is the action about to be chosen (a placeholder).
        taken = action[action.shape[0] - (steps - 1):] if steps > 1 else action[:0]
        actions = torch.cat([taken, taken.new_zeros(1, self.model.act_dim)])
        normalized = (window - self.model.obs_mean) / self.model.obs_std
        self.state = self.model.observe_context(normalized.unsqueeze(0), actions.unsqueeze(0))

    @torch.no_grad()
    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Predicted rewards [N,H] of action sequences [N,H,A] from the observed state."""
        _, rewards = imagine_sequences(self.model, self.state, actions)
        return rewards


def _angle_normalize(theta: torch.Tensor) -> torch.Tensor:
    return torch.remainder(theta + math.pi, 2 * math.pi) - math.pi


class PendulumSimulator:
    """Gymnasium's Pendulum-v1 equations, batched in torch: the planner's ceiling (a perfect model).

    The state comes from the observation (cos, sin, angular velocity), as a learned model's does.
    """

    max_torque, max_speed, dt, g, m, length = 2.0, 8.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self) -> None:
        self.theta = self.theta_dot = None

    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Take the state from the newest observation [T,O]."""
        cos_th, sin_th, theta_dot = obs[-1].double()
        self.theta, self.theta_dot = torch.atan2(sin_th, cos_th), theta_dot

    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Exact rewards [N,H] of action sequences [N,H,1]."""
        n, horizon = actions.shape[:2]
        theta = self.theta.expand(n).clone()
        theta_dot = self.theta_dot.expand(n).clone()
        rewards = []
        for t in range(horizon):
            u = actions[:, t, 0].double().clamp(-self.max_torque, self.max_torque)
            rewards.append(-(_angle_normalize(theta) ** 2 + 0.1 * theta_dot**2 + 0.001 * u**2))
            accel = 3 * self.g / (2 * self.length) * torch.sin(theta) + 3.0 / (self.m * self.length**2) * u
            theta_dot = (theta_dot + accel * self.dt).clamp(-self.max_speed, self.max_speed)
            theta = theta + theta_dot * self.dt
        return torch.stack(rewards, dim=1).float()


TRUE_SIMULATORS = {"Pendulum-v1": PendulumSimulator}


def true_simulator(env_id: str) -> PendulumSimulator:
    """The batched exact simulator of ``env_id`` (ControlError where the project has none)."""
    try:
        return TRUE_SIMULATORS[env_id]()
    except KeyError:
        raise ControlError(f"no true simulator for {env_id!r} (have: {', '.join(TRUE_SIMULATORS)}); "
                           "closed-loop control is evaluated on those envs only") from None

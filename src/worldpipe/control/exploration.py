"""Exploration while collecting: a bonus the planner earns for imagining observations unlike any it has data of.

Gaussian action noise (:class:`worldpipe.control.collection.ExploringAgent`) explores only near where the planner
already goes. Where the reward is sparse (DeepMind Control's pendulum-swingup pays only with the pole near upright),
random data rarely shows the model a reward, its imagined returns are all about zero, and the planner has nothing
to climb. The novelty bonus gives it something: each imagined step earns ``weight`` times the distance from its
predicted observation to the nearest of ``reference`` observations of the data the model trained on (in units of
that data's standard deviation per feature), so the planner drives towards states the data lacks, such as a
pendulum swinging higher than before. Once rewards are in the data, the model predicts them and the reward term
takes over where it is larger than the bonus.

The reference observations are a fixed, evenly strided subset of the collecting run's training data (its dataset
is part of the collected dataset's lineage), so a collected episode stays a pure function of its spec, its index
and the checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch

from worldpipe.control.dynamics import LearnedDynamics
from worldpipe.data.store import TrajectoryStore


def reference_observations(store: TrajectoryStore, count: int) -> torch.Tensor:
    """``count`` observations [count,O] (or all, if fewer) evenly strided over ``store``'s valid steps."""
    arrays = store.read_episodes(0, store.num_episodes)
    valid = np.concatenate([arrays["obs"][i, :n] for i, n in enumerate(arrays["length"])])
    rows = np.unique(np.linspace(0, len(valid) - 1, num=min(count, len(valid))).round().astype(np.int64))
    return torch.from_numpy(np.ascontiguousarray(valid[rows], dtype=np.float32))


class NoveltySeeking:
    """A learned model's imagined rewards plus ``weight`` times each imagined observation's distance to the nearest
    reference observation (both scaled by the model's observation std): what the planner maximises."""

    def __init__(self, dynamics: LearnedDynamics, reference: torch.Tensor, weight: float) -> None:
        self.dynamics, self.weight = dynamics, float(weight)
        self.scale = dynamics.model.obs_std.reshape(-1)
        self.reference = reference / self.scale

    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """As the model's own dynamics: filter the latest observations."""
        self.dynamics.observe(obs, action)

    @torch.no_grad()
    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Imagined rewards plus the novelty bonus [N,H] of action sequences [N,H,A]."""
        observations, rewards = self.dynamics.imagine_observations(actions)
        scaled = (observations / self.scale).reshape(-1, observations.shape[-1])
        # Without the matrix-product shortcut: exact distances (a point of the reference is 0 away, not 1e-7).
        nearest = torch.cdist(scaled, self.reference, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
        return rewards + self.weight * nearest.view(rewards.shape)

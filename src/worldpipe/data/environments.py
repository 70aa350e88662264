"""Environment construction and the shape facts the store needs (observation / action width)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import numpy as np

# Rendering must never open a window or touch audio (headless CI, SLURM nodes). These must be set
# before pygame initialises, hence at import time of the only module that creates envs.
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym  # noqa: E402  (must follow the SDL environment setup)


@dataclass(frozen=True)
class EnvDims:
    """Widths of the stored observation and action vectors."""

    obs_dim: int
    act_dim: int
    discrete_actions: bool


def make_env(env_id: str, max_steps: int, render: bool) -> gym.Env:
    """Create ``env_id`` with its time limit set to ``max_steps``; rgb_array rendering when ``render``."""
    return gym.make(
        env_id,
        max_episode_steps=max_steps,
        render_mode="rgb_array" if render else None,
        disable_env_checker=True,
    )


@cache
def env_dims(env_id: str) -> EnvDims:
    """Observation/action widths of ``env_id``; a discrete action is stored as one float."""
    env = gym.make(env_id, disable_env_checker=True)
    try:
        obs_dim = int(np.prod(env.observation_space.shape))
        if isinstance(env.action_space, gym.spaces.Discrete):
            return EnvDims(obs_dim=obs_dim, act_dim=1, discrete_actions=True)
        return EnvDims(obs_dim=obs_dim, act_dim=int(np.prod(env.action_space.shape)), discrete_actions=False)
    finally:
        env.close()


def env_action(action: np.ndarray, dims: EnvDims) -> int | np.ndarray:
    """Convert the stored float action into what ``env.step`` expects."""
    if dims.discrete_actions:
        return int(action[0])
    return action

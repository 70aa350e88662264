"""Environment construction and the shape facts the store needs (observation / action width).

Gymnasium's own envs observe a flat Box. DeepMind Control suite tasks (``dm_control/<domain>-<task>-v0``, through
shimmy's Gymnasium bindings, imported only when such an env is made) observe a dict of arrays: they are flattened
into one float vector in the order ``observation_keys`` names (the dataset spec records it, so the order is part of
the dataset's identity), and an ``action_repeat`` > 1 repeats each action that many physics control steps, summing
the rewards (one stored step per decision; ``max_steps`` counts decisions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import numpy as np

from worldpipe.core.errors import UsageError

# Rendering must never open a window or touch audio (headless CI, SLURM nodes). These must be set
# before pygame initialises, hence at import time of the only module that creates envs.
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
# MuJoCo's renderer (DeepMind Control) without a display: EGL, headless. Read when dm_control is first imported.
os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402  (must follow the SDL environment setup)


@dataclass(frozen=True)
class EnvDims:
    """Widths of the stored observation and action vectors."""

    obs_dim: int
    act_dim: int
    discrete_actions: bool


DMC_PREFIX = "dm_control/"


class EnvSetupError(UsageError, ValueError):
    """An env that cannot be made as asked (an observation key it lacks); the message names the key and the fix."""


def is_dmc(env_id: str) -> bool:
    """True for a DeepMind Control suite task (``dm_control/<domain>-<task>-v0``)."""
    return env_id.startswith(DMC_PREFIX)


def _register_dmc() -> None:
    import shimmy  # start-up: dm_control and MuJoCo load only where a DeepMind Control task is made

    gym.register_envs(shimmy)


class FlatDictObservation(gym.ObservationWrapper):
    """A dict observation as one float64 vector: each key's array flattened, in ``keys`` order."""

    def __init__(self, env: gym.Env, keys: tuple[str, ...]) -> None:
        super().__init__(env)
        self.keys = keys
        width = sum(int(np.prod(env.observation_space[key].shape)) for key in keys)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (width,), np.float64)

    def observation(self, observation):
        return np.concatenate([np.asarray(observation[key], np.float64).reshape(-1) for key in self.keys])


class ActionRepeat(gym.Wrapper):
    """Each action held for ``repeat`` control steps of the inner env; the rewards summed, the episode ended at
    the first inner end."""

    def __init__(self, env: gym.Env, repeat: int) -> None:
        super().__init__(env)
        self.repeat = repeat

    def step(self, action):
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


def observation_keys_of(env: gym.Env) -> tuple[str, ...] | None:
    """The keys of a dict observation in the env's own order (None for a flat observation)."""
    space = env.observation_space
    return tuple(space.spaces) if isinstance(space, gym.spaces.Dict) else None


def check_observation_keys(env_id: str, found: tuple[str, ...] | None, keys) -> tuple[str, ...] | None:
    """``keys`` checked against the env's dict observation (EnvSetupError, one line, names what is wrong)."""
    if found is None:
        if keys:
            raise EnvSetupError(f"dataset spec key 'observation_keys': {env_id} observes a flat vector, not a "
                                    f"dict; leave observation_keys out")
        return None
    if not keys:
        raise EnvSetupError(f"dataset spec key 'observation_keys' is required for {env_id} (a dict "
                                f"observation): the order its keys are flattened in, e.g. {list(found)}")
    keys = tuple(keys)
    missing = [key for key in keys if key not in found]
    if missing:
        raise EnvSetupError(f"dataset spec key 'observation_keys': {env_id} has no observation "
                                f"{missing[0]!r} (its keys: {', '.join(found)})")
    left_out = [key for key in found if key not in keys]
    if left_out or len(set(keys)) != len(keys):
        raise EnvSetupError(f"dataset spec key 'observation_keys': {list(keys)} must name each of {env_id}'s "
                                f"observations once ({', '.join(found)})")
    return keys


def make_env(env_id: str, max_steps: int, render: bool, action_repeat: int = 1,
             observation_keys=None) -> gym.Env:
    """Create ``env_id`` with its time limit set to ``max_steps`` decisions; rgb_array rendering when ``render``;
    a dict observation flattened in ``observation_keys`` order; each action repeated ``action_repeat`` times."""
    if is_dmc(env_id):
        _register_dmc()
        if render:
            raise EnvSetupError(f"dataset spec key 'pixels': {env_id} is collected from state here (pixels: "
                                    "false)")
    env = gym.make(
        env_id,
        max_episode_steps=max_steps * action_repeat,
        render_mode="rgb_array" if render else None,
        disable_env_checker=True,
    )
    try:
        keys = check_observation_keys(env_id, observation_keys_of(env), observation_keys)
    except EnvSetupError:
        env.close()
        raise
    if action_repeat > 1:
        env = ActionRepeat(env, action_repeat)
    return FlatDictObservation(env, keys) if keys else env


def make_bare_env(env_id: str) -> gym.Env:
    """``env_id`` as registered (no wrappers, its own time limit): for its spaces and timing only."""
    if is_dmc(env_id):
        _register_dmc()
    return gym.make(env_id, disable_env_checker=True)


@cache
def env_dims(env_id: str) -> EnvDims:
    """Observation/action widths of ``env_id`` (a dict observation: all its keys flattened); a discrete action is
    stored as one float."""
    env = make_bare_env(env_id)
    try:
        keys = observation_keys_of(env)
        space = env.observation_space
        obs_dim = (sum(int(np.prod(space[key].shape)) for key in keys) if keys
                   else int(np.prod(space.shape)))
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

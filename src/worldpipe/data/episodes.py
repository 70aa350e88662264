"""Simulate one episode as a pure function of (dataset spec, episode index)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worldpipe.data.environments import env_action, env_dims, make_env
from worldpipe.data.pixels import downscale
from worldpipe.data.policies import get_policy
from worldpipe.data.spec import DatasetSpec


@dataclass
class Episode:
    """One trajectory of ``L`` steps (``L <= max_steps``; shorter when the env terminates).

    ``obs[t]`` is the observation before ``action[t]``; ``reward[t]`` and ``terminated[t]`` are what the
    env returned after it. ``pixels[t]`` (optional) is the rendered frame of ``obs[t]``.
    """

    obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    pixels: np.ndarray | None

    def __len__(self) -> int:
        return int(self.obs.shape[0])


def episode_seeds(seed: int, episode_index: int) -> tuple[int, np.random.Generator]:
    """Env reset seed and policy generator, both derived only from ``SeedSequence([seed, episode_index])``.

    Nothing here depends on which worker simulates the episode or in what order, so the bytes of a
    shard never depend on how the job was split.
    """
    env_ss, policy_ss = np.random.SeedSequence([seed, episode_index]).spawn(2)
    reset_seed = int(env_ss.generate_state(1, dtype=np.uint32)[0])
    return reset_seed, np.random.Generator(np.random.PCG64(policy_ss))


def simulate_episode(spec: DatasetSpec, episode_index: int) -> Episode:
    """Roll out the spec's policy in its env for episode ``episode_index`` (deterministic)."""
    if not 0 <= episode_index < spec.episodes:
        raise ValueError(f"episode index {episode_index} out of range [0, {spec.episodes})")
    dims = env_dims(spec.env_id)
    policy = get_policy(spec.env_id, spec.policy)
    reset_seed, rng = episode_seeds(spec.seed, episode_index)

    obs_buf = np.zeros((spec.max_steps, dims.obs_dim), np.float32)
    act_buf = np.zeros((spec.max_steps, dims.act_dim), np.float32)
    rew_buf = np.zeros((spec.max_steps,), np.float32)
    term_buf = np.zeros((spec.max_steps,), bool)
    pix_buf = (
        np.zeros((spec.max_steps, spec.pixel_size, spec.pixel_size, 3), np.uint8) if spec.pixels else None
    )

    env = make_env(spec.env_id, spec.max_steps, render=spec.pixels, **spec.env_options)
    try:
        obs, _ = env.reset(seed=reset_seed)
        length = 0
        for t in range(spec.max_steps):
            obs_buf[t] = np.asarray(obs, np.float32).reshape(-1)
            if pix_buf is not None:
                pix_buf[t] = downscale(env.render(), spec.pixel_size)
            action = policy(obs_buf[t], rng)
            act_buf[t] = action
            obs, reward, terminated, truncated, _ = env.step(env_action(action, dims))
            rew_buf[t] = reward
            term_buf[t] = terminated
            length = t + 1
            if terminated or truncated:
                break
    finally:
        env.close()

    return Episode(
        obs=obs_buf[:length].copy(),
        action=act_buf[:length].copy(),
        reward=rew_buf[:length].copy(),
        terminated=term_buf[:length].copy(),
        pixels=None if pix_buf is None else pix_buf[:length].copy(),
    )

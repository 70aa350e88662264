"""Behaviour policies that generate the trajectories: uniform random and a scripted controller with noise.

Every policy draws randomness only from the ``np.random.Generator`` it is given, never from the env's
action space, so an episode is a pure function of its seed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from worldpipe.data.spec import DMC_TASKS

Policy = Callable[[np.ndarray, np.random.Generator], np.ndarray]

# Pendulum-v1 constants (gymnasium): max torque 2, g = 10, m = l = 1, theta = 0 is upright.
_PENDULUM_MAX_TORQUE = 2.0
_PENDULUM_NOISE_STD = 0.3
# CartPole: probability of replacing the controller's action by a coin flip.
_CARTPOLE_EPSILON = 0.1


def _pendulum_random(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-_PENDULUM_MAX_TORQUE, _PENDULUM_MAX_TORQUE, size=(1,)).astype(np.float32)


def _pendulum_controller(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    cos_th, sin_th, th_dot = (float(v) for v in obs)
    theta = np.arctan2(sin_th, cos_th)
    if cos_th > 0.85:
        # Near the top: PD stabilisation.
        u = -(10.0 * theta + 2.0 * th_dot)
    else:
        # Energy pumping towards the upright rest energy (E = th_dot^2/6 + 5 cos th, target 5).
        energy = th_dot**2 / 6.0 + 5.0 * cos_th
        u = 2.0 * th_dot * (5.0 - energy)
        if abs(th_dot) < 1e-3:
            u = _PENDULUM_MAX_TORQUE  # kick out of the bottom rest point
    u += rng.normal(0.0, _PENDULUM_NOISE_STD)
    return np.array([np.clip(u, -_PENDULUM_MAX_TORQUE, _PENDULUM_MAX_TORQUE)], dtype=np.float32)


def _cartpole_random(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.array([rng.integers(0, 2)], dtype=np.float32)


def _cartpole_controller(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x, x_dot, theta, theta_dot = (float(v) for v in obs)
    # Push the cart under the pole; the small cart terms keep it from drifting off the track.
    push_right = theta + 0.5 * theta_dot + 0.01 * x + 0.1 * x_dot > 0.0
    # Always draw both numbers so the RNG stream position does not depend on the branch taken.
    explore, coin = rng.random(), rng.integers(0, 2)
    action = int(coin) if explore < _CARTPOLE_EPSILON else int(push_right)
    return np.array([action], dtype=np.float32)


_POLICIES: dict[tuple[str, str], Policy] = {
    ("Pendulum-v1", "random"): _pendulum_random,
    ("Pendulum-v1", "noisy_controller"): _pendulum_controller,
    ("CartPole-v1", "random"): _cartpole_random,
    ("CartPole-v1", "noisy_controller"): _cartpole_controller,
}


def _box_random(width: int) -> Policy:
    def random_actions(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(-1.0, 1.0, size=(width,)).astype(np.float32)

    return random_actions


# DeepMind Control tasks act in [-1, 1]^width: uniform random actions (the loop from scratch's round 0).
_POLICIES.update({(env_id, "random"): _box_random(width) for env_id, width in DMC_TASKS.items()})


def policies_for(env_id: str) -> list[str]:
    """The names of the scripted policies ``env_id`` has (sorted; empty for an env without any)."""
    return sorted(name for env, name in _POLICIES if env == env_id)


def get_policy(env_id: str, policy: str) -> Policy:
    """Return the policy function for ``(env_id, policy)``; ValueError if the pair is unknown."""
    try:
        return _POLICIES[(env_id, policy)]
    except KeyError:
        raise ValueError(f"no policy {policy!r} for env {env_id!r}") from None

"""Episode simulation: seeded only by (seed, episode index), variable lengths, headless pixels."""

import numpy as np
import pytest

from worldpipe.data.episodes import simulate_episode
from worldpipe.data.pixels import downscale
from worldpipe.data.spec import DatasetSpec


def _spec(env_id="CartPole-v1", policy="random", **kw):
    d = dict(name="t", env_id=env_id, policy=policy, episodes=8, max_steps=60, episodes_per_shard=4, seed=3)
    d.update(kw)
    return DatasetSpec(**d)


def _same(a, b):
    return all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("obs", "action", "reward", "terminated")
    )


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
@pytest.mark.parametrize("policy", ["random", "noisy_controller"])
def test_deterministic_and_independent_of_order(env_id, policy):
    spec = _spec(env_id, policy, max_steps=40)
    forward = [simulate_episode(spec, i) for i in range(4)]
    backward = [simulate_episode(spec, i) for i in reversed(range(4))][::-1]
    assert all(_same(a, b) for a, b in zip(forward, backward, strict=True))
    assert not _same(forward[0], forward[1])  # different episode index -> different episode


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_shapes_and_dtypes(env_id):
    ep = simulate_episode(_spec(env_id), 0)
    n = len(ep)
    obs_dim = 3 if env_id == "Pendulum-v1" else 4
    assert ep.obs.shape == (n, obs_dim) and ep.obs.dtype == np.float32
    assert ep.action.shape == (n, 1) and ep.action.dtype == np.float32
    assert ep.reward.shape == (n,) and ep.reward.dtype == np.float32
    assert ep.terminated.shape == (n,) and ep.terminated.dtype == bool
    assert ep.pixels is None


def test_seed_changes_episode():
    a = simulate_episode(_spec(seed=1), 0)
    b = simulate_episode(_spec(seed=2), 0)
    assert not _same(a, b)


def test_cartpole_random_terminates_with_varied_lengths():
    spec = _spec(max_steps=200)
    episodes = [simulate_episode(spec, i) for i in range(8)]
    lengths = [len(e) for e in episodes]
    assert len(set(lengths)) > 1
    for e in episodes:
        if len(e) < spec.max_steps:
            assert e.terminated[-1] and not e.terminated[:-1].any()
    assert set(np.concatenate([e.action[:, 0] for e in episodes])) <= {0.0, 1.0}


def test_pendulum_runs_to_max_steps_and_respects_torque_limit():
    spec = _spec("Pendulum-v1", "noisy_controller", max_steps=50)
    ep = simulate_episode(spec, 1)
    assert len(ep) == 50 and not ep.terminated.any()
    assert np.abs(ep.action).max() <= 2.0


def test_episode_index_bounds():
    with pytest.raises(ValueError, match="episode index"):
        simulate_episode(_spec(), 8)


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_pixels_headless(env_id):
    spec = _spec(env_id, pixels=True, pixel_size=16, max_steps=5)
    ep = simulate_episode(spec, 0)
    assert ep.pixels is not None
    assert ep.pixels.shape == (len(ep), 16, 16, 3) and ep.pixels.dtype == np.uint8
    assert ep.pixels.std() > 0  # a real rendering, not a blank frame
    again = simulate_episode(spec, 0)
    assert np.array_equal(ep.pixels, again.pixels)


def test_downscale_block_average():
    frame = np.zeros((4, 6, 3), np.uint8)
    frame[:2, :3] = 200
    frame[2:, 3:] = 11
    out = downscale(frame, 2)
    assert out.shape == (2, 2, 3)
    assert (
        out[0, 0].tolist() == [200] * 3 and out[1, 1].tolist() == [11] * 3 and out[0, 1].tolist() == [0] * 3
    )
    # Round-half-up integer division: mean of {0, 1} rounds to 1.
    assert downscale(np.array([[[0] * 3, [1] * 3]], np.uint8), 1)[0, 0, 0] == 1
    with pytest.raises(ValueError):
        downscale(frame, 8)

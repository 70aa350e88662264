"""DeepMind Control tasks from state through shimmy's Gymnasium bindings: the dict observation flattened in the
order the spec records, action repeat as the spec sets it, bad input as one line, and the true simulator (MuJoCo's
state copied from the observation) giving the real env's rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldpipe.data.environments import EnvSetupError, make_env
from worldpipe.data.episodes import simulate_episode
from worldpipe.data.spec import DatasetSpec, spec_hash

CARTPOLE = "dm_control/cartpole-swingup-v0"
PENDULUM = "dm_control/pendulum-swingup-v0"
KEYS = {CARTPOLE: ["position", "velocity"], PENDULUM: ["orientation", "velocity"]}


def spec(env_id: str = CARTPOLE, **changes) -> DatasetSpec:
    raw = {"name": "dmc", "env_id": env_id, "policy": "random", "episodes": 2, "max_steps": 12,
           "episodes_per_shard": 2, "seed": 0, "action_repeat": 4, "observation_keys": KEYS[env_id], **changes}
    return DatasetSpec.from_dict(raw)


def test_an_unknown_task_is_one_line_naming_the_key():
    with pytest.raises(ValueError) as err:
        DatasetSpec.from_dict({**spec().to_dict(), "env_id": "dm_control/cartpole-swingupp-v0"})
    message = str(err.value)
    assert message.startswith("dataset spec key 'env_id' has unsupported value 'dm_control/cartpole-swingupp-v0'")
    assert CARTPOLE in message and "\n" not in message


def test_a_flat_envs_spec_keeps_its_hash_and_a_dmc_spec_records_its_key_order():
    raw = {"name": "p", "env_id": "Pendulum-v1", "policy": "random", "episodes": 2, "max_steps": 10,
           "episodes_per_shard": 2, "seed": 0}
    assert spec_hash(raw) == spec_hash({**raw, "action_repeat": 1, "observation_keys": None})
    assert "action_repeat" not in DatasetSpec.from_dict(raw).to_dict()
    recorded = spec().to_dict()
    assert recorded["observation_keys"] == ["position", "velocity"] and recorded["action_repeat"] == 4
    assert spec_hash(recorded) != spec_hash({**recorded, "observation_keys": ["velocity", "position"]})


def test_the_observation_is_flattened_in_the_recorded_order():
    forward = simulate_episode(spec(), 0)
    backward = simulate_episode(spec(observation_keys=["velocity", "position"]), 0)
    assert forward.obs.shape == (12, 5)
    np.testing.assert_array_equal(forward.obs, np.concatenate([backward.obs[:, 2:], backward.obs[:, :2]], axis=1))
    np.testing.assert_array_equal(forward.reward, backward.reward)


def test_an_action_is_held_for_the_repeat_and_its_rewards_summed():
    held = make_env(CARTPOLE, 5, False, action_repeat=4, observation_keys=KEYS[CARTPOLE])
    single = make_env(CARTPOLE, 20, False, action_repeat=1, observation_keys=KEYS[CARTPOLE])
    try:
        np.testing.assert_array_equal(held.reset(seed=3)[0], single.reset(seed=3)[0])
        for action in np.linspace(-1, 1, 5):
            obs, reward, *_ = held.step(np.array([action]))
            total = 0.0
            for _ in range(4):
                inner, r, *_ = single.step(np.array([action]))
                total += r
            np.testing.assert_array_equal(obs, inner)
            assert reward == pytest.approx(total, abs=1e-12)
    finally:
        held.close()
        single.close()


@pytest.mark.parametrize(("keys", "needle"), [
    (["position", "speed"], "dm_control/cartpole-swingup-v0 has no observation 'speed' (its keys: position, velocity)"),
    (["position"], "must name each of dm_control/cartpole-swingup-v0's observations once"),
    (None, "dataset spec key 'observation_keys' is required for dm_control/cartpole-swingup-v0"),
])
def test_observation_keys_that_do_not_fit_the_env_are_one_line(keys, needle):
    with pytest.raises(EnvSetupError) as err:
        make_env(CARTPOLE, 5, False, observation_keys=keys)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("env_id", [CARTPOLE, pytest.param(PENDULUM, marks=pytest.mark.slow)])  # seconds each
def test_the_true_simulator_gives_the_real_envs_rewards(env_id):
    from worldpipe.control.dynamics import true_simulator

    dataset = spec(env_id, max_steps=40)
    episode = simulate_episode(dataset, 0)
    simulator = true_simulator(env_id, dataset.env_options)
    for start in (0, 17):
        simulator.observe(torch.from_numpy(episode.obs[:start + 1]), torch.from_numpy(episode.action[:start]))
        rewards = simulator.imagine(torch.from_numpy(episode.action[start:start + 12])[None])[0].numpy()
        np.testing.assert_allclose(rewards, episode.reward[start:start + 12], atol=1e-5)

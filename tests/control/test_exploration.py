"""The novelty bonus of collection rounds: imagined rewards plus the distance from each imagined observation to the
nearest observation of the collecting run's data, in that data's standard deviations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldpipe.control.dynamics import LearnedDynamics
from worldpipe.control.exploration import NoveltySeeking, reference_observations
from worldpipe.data.manifest import load_manifest
from worldpipe.data.spec import check_novelty
from worldpipe.data.store import TrajectoryStore
from worldpipe.models.rssm import RSSM
from worldpipe.rollout.engine import imagine_sequences

STD = torch.tensor([1.0, 2.0, 4.0])


@pytest.fixture
def observed() -> LearnedDynamics:
    torch.manual_seed(0)
    model = RSSM(3, 1, embed=16, deter=16, stoch=4, hidden=32).eval()
    model.set_normalization(np.zeros(3, np.float32), STD.numpy())
    dynamics = LearnedDynamics(model, context=4)
    dynamics.observe(torch.randn(6, 3), torch.rand(5, 1) * 2 - 1)
    return dynamics


def test_the_bonus_is_the_scaled_distance_to_the_nearest_reference_observation(observed):
    candidates = torch.rand(5, 6, 1, generator=torch.Generator().manual_seed(1)) * 2 - 1
    imagined, rewards = imagine_sequences(observed.model, observed.state, candidates)
    flat = imagined.reshape(-1, 3)
    # Every imagined observation is in the reference: nothing is novel, the planner sees the model's rewards.
    assert torch.equal(NoveltySeeking(observed, flat, weight=2.0).imagine(candidates), rewards)
    # A reference of two far points: each step earns the weight times its distance to the nearer, in data stds.
    far = torch.tensor([[10.0, -20.0, 40.0], [-10.0, 20.0, -40.0]])
    nearest = torch.stack([min(((row - point) / STD).norm() for point in far) for row in flat]).view(rewards.shape)
    torch.testing.assert_close(NoveltySeeking(observed, far, weight=0.5).imagine(candidates), rewards + 0.5 * nearest)


def test_reference_observations_are_evenly_strided_valid_steps(smoke_dataset):
    store_path, manifest_path = smoke_dataset
    store = TrajectoryStore.open(str(store_path), load_manifest(str(manifest_path)))
    arrays = store.read_episodes(0, store.num_episodes)
    valid = np.concatenate([arrays["obs"][i, :n] for i, n in enumerate(arrays["length"])])
    picked = reference_observations(store, 10).numpy()
    assert picked.shape == (10, valid.shape[1])
    assert np.array_equal(picked[0], valid[0]) and np.array_equal(picked[-1], valid[-1])
    assert all((valid == row).all(axis=1).any() for row in picked)  # steps of episodes, never padding
    assert np.array_equal(reference_observations(store, 10 ** 9).numpy(), valid)


@pytest.mark.parametrize("novelty", [{"weight": 0, "reference": 8}, {"weight": -1.0, "reference": 8},
                                     {"weight": True, "reference": 8}, {"weight": 1.0, "reference": 0},
                                     {"weight": 1.0}, {"weight": 1.0, "reference": 8, "k": 3}])
def test_a_novelty_block_that_cannot_work_is_refused_in_one_line(novelty):
    with pytest.raises(ValueError, match=r"^dataset spec key 'collector.novelty' must be \{weight: a number > 0, "
                                         r"reference: an integer >= 1\}, got ") as err:
        check_novelty(novelty)
    assert "\n" not in str(err.value)

"""Planners and the true simulator, in-process against real Gymnasium Pendulum-v1 episodes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from worldpipe.config.planner import planner_config
from worldpipe.control.dynamics import LearnedDynamics, PendulumSimulator, true_simulator
from worldpipe.control.episodes import PARTS, PlannerAgent, PolicyAgent, run_episode
from worldpipe.control.evaluation import build_planner, normalised_score, summarize
from worldpipe.control.planners import CEM, MPPI
from worldpipe.core.errors import UserError
from worldpipe.data.environments import make_env
from worldpipe.data.episodes import episode_seeds
from worldpipe.data.policies import get_policy
from worldpipe.models.rssm import RSSM
from worldpipe.rollout.engine import imagine_sequences
from worldpipe.rollout.streams import StreamId


def test_the_true_simulator_predicts_gymnasiums_rewards_and_states():
    env = make_env("Pendulum-v1", 50, render=False)
    obs, _ = env.reset(seed=3)
    actions = torch.from_numpy(np.random.default_rng(0).uniform(-2.5, 2.5, size=(1, 30, 1)).astype(np.float32))
    simulator = PendulumSimulator()
    simulator.observe(torch.from_numpy(np.asarray(obs, np.float32))[None], torch.zeros(0, 1))
    predicted = simulator.imagine(actions)[0]
    real = [env.step(actions[0, t].numpy())[1] for t in range(30)]
    env.close()
    # From a float32 observation, the simulated state drifts from the env's float64 one only by rounding.
    np.testing.assert_allclose(predicted.numpy(), np.asarray(real, np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("planner_class", [MPPI, CEM])
def test_a_planner_with_the_true_simulator_balances_where_random_actions_fall(planner_class):
    reset_seed, _ = episode_seeds(5000, 3)  # starts near upright
    planner = planner_class(horizon=10, samples=64, iterations=2).bounded(-2.0, 2.0)
    agent = PlannerAgent(planner, true_simulator("Pendulum-v1"), StreamId(0, "test"))
    planned = run_episode("Pendulum-v1", 60, reset_seed, np.random.default_rng(0), agent)
    random = run_episode("Pendulum-v1", 60, reset_seed, np.random.default_rng(0),
                         PolicyAgent(get_policy("Pendulum-v1", "random")))
    assert planned.length == random.length == 60
    assert planned.episode_return > random.episode_return + 50, (planned.episode_return, random.episode_return)
    assert set(planned.timings) == set(PARTS) and all(len(v) == 60 for v in planned.timings.values())
    assert min(planned.timings["model"]) > 0 and max(planned.timings["transport"]) == 0


def test_the_same_stream_gives_the_same_actions_and_another_stream_other_ones():
    reset_seed, _ = episode_seeds(5000, 0)

    def episode(stream: str):
        planner = MPPI(horizon=6, samples=16, iterations=2).bounded(-2.0, 2.0)
        agent = PlannerAgent(planner, true_simulator("Pendulum-v1"), StreamId(0, stream))
        return run_episode("Pendulum-v1", 15, reset_seed, np.random.default_rng(0), agent)

    first, again, other = episode("a"), episode("a"), episode("b")
    assert first.actions_sha256 == again.actions_sha256 and first.episode_return == again.episode_return
    assert other.actions_sha256 != first.actions_sha256


def test_learned_dynamics_imagine_every_candidate_from_the_filtered_window():
    torch.manual_seed(0)
    model = RSSM(3, 1, embed=8, deter=8, stoch=4, hidden=16).eval()
    dynamics = LearnedDynamics(model, context=4)
    obs, actions = torch.randn(6, 3), torch.randn(5, 1)
    dynamics.observe(obs[-4:], actions[-3:])
    candidates = torch.randn(5, 7, 1).clamp(-1, 1)
    candidates[1] = candidates[0]
    rewards = dynamics.imagine(candidates)
    assert rewards.shape == (5, 7)
    torch.testing.assert_close(rewards[1], rewards[0])
    # one candidate alone from the same state: what a batch of one imagines (up to the kernel's batch rounding)
    _, alone = imagine_sequences(model, dynamics.state, candidates[2:3])
    torch.testing.assert_close(alone[0], rewards[2], rtol=1e-5, atol=1e-6)


def test_summaries_and_scores():
    summary = summarize([-100.0, -200.0, -300.0])
    assert summary["mean"] == -200.0 and summary["ci95"][0] < -200.0 < summary["ci95"][1]
    assert summary["ci95"][1] - summary["ci95"][0] == pytest.approx(2 * 4.302653 * 100 / 3 ** 0.5, rel=1e-5)
    assert normalised_score(-150.0, random=-1000.0, ceiling=-150.0) == 1.0
    assert normalised_score(-1000.0, random=-1000.0, ceiling=-150.0) == 0.0
    assert normalised_score(-5.0, random=-5.0, ceiling=-5.0) is None


def test_envs_without_a_true_simulator_are_refused_in_one_line():
    with pytest.raises(UserError, match="no true simulator for 'CartPole-v1'"):
        true_simulator("CartPole-v1")


@pytest.mark.parametrize(("name", "overrides", "needle"), [
    ("nope", [], "no planner 'nope' in"),
    ("mppi", ["horizn=3"], "planner override 'horizn=3': mppi has no key 'horizn'"),
    ("mppi", ["samples=abc"], "planner override 'samples=abc': samples must be int"),
    ("cem", ["samples=1.5"], "planner override 'samples=1.5': samples must be int"),
    ("cem", ["elite_fraction"], "planner override 'elite_fraction': cem has no key 'elite_fraction'"),
])
def test_bad_planner_settings_are_refused_naming_the_key(repo, name, overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        planner_config(name, overrides, repo / "conf")


def test_planner_settings_compose_from_conf_with_typed_overrides(repo):
    config = planner_config("cem", ["horizon=7", "momentum=0"], repo / "conf")
    assert config["_target_"] == "worldpipe.control.planners.CEM"
    assert config["horizon"] == 7 and config["momentum"] == 0.0 and isinstance(config["momentum"], float)
    planner = build_planner(config, -2.0, 2.0)
    assert isinstance(planner, CEM) and planner.horizon == 7 and planner.action_high == 2.0


def test_the_heap_loaded_before_the_episodes_is_out_of_the_collectors_sight_while_they_run():
    import gc

    from worldpipe.control.evaluation import long_lived_heap_frozen

    loaded = [object() for _ in range(10)]  # what the evaluation loaded before its episodes
    assert gc.get_freeze_count() == 0
    with long_lived_heap_frozen():
        assert gc.get_freeze_count() >= len(loaded)
    assert gc.get_freeze_count() == 0

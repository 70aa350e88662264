"""The planner's terminal value: fitted value iteration through the model, on states of its training data, and
the planner's imagined rewards carrying it past the horizon."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worldpipe.config.value import ValueSettings, value_settings
from worldpipe.control.dynamics import LearnedDynamics
from worldpipe.control.value import fit_actor_critic, fit_value, lambda_returns, training_windows
from worldpipe.data.manifest import load_manifest
from worldpipe.data.spec import check_collector
from worldpipe.data.store import TrajectoryStore
from worldpipe.models.rssm import RSSM
from worldpipe.rollout.engine import imagine_sequences

REWARD = 1.5


def constant_reward_model(reward: float) -> RSSM:
    """A real RSSM whose reward head answers ``reward`` from every latent state."""
    torch.manual_seed(0)
    model = RSSM(3, 1, embed=16, deter=16, stoch=4, hidden=32).eval()
    model.set_normalization(np.zeros(3, np.float32), np.array([1.0, 2.0, 4.0], np.float32))
    with torch.no_grad():
        model.reward_head[-1].weight.zero_()
        model.reward_head[-1].bias.fill_(reward)
    return model


def windows(count: int = 64, context: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    actions = torch.rand(count, context, 1, generator=generator) * 2 - 1
    actions[:, -1] = 0
    return torch.randn(count, context, 3, generator=generator), actions


def actor_critic(**changed) -> dict:
    return value_settings({"method": "actor_critic", "states": 64, "fit_steps": 300, "batch": 32, "hidden": 32,
                           "learning_rate": 1e-2, "actor_learning_rate": 1e-2, "target_update": 0.2, **changed},
                          "value")


def settings(**changed) -> dict:
    return value_settings({"iterations": 3, "states": 64, "candidates": 4, "fit_steps": 600, "hidden": 32,
                           "learning_rate": 1e-2, **changed}, "value")


def test_backups_add_one_discounted_horizon_each():
    """Every step pays REWARD: after k backups of H steps the value is the discounted sum of k*H rewards, the
    closed form fitted value iteration must reach (any mistake in the discounting or the bootstrap misses it)."""
    model, horizon, discount = constant_reward_model(REWARD), 4, 0.9
    obs, _ = windows()
    for iterations in (1, 3):
        value = fit_value(model, windows(), settings(iterations=iterations), horizon, discount, (-1.0, 1.0), seed=0)
        expected = REWARD * (1 - discount ** (iterations * horizon)) / (1 - discount)
        torch.testing.assert_close(value(obs[:, -1]), torch.full((64,), expected), rtol=0.02, atol=0.0)


def test_a_fit_is_a_function_of_its_inputs_and_seed():
    model = constant_reward_model(0.0)
    with torch.no_grad():  # rewards that depend on the state and the actions
        model.reward_head[-1].weight.normal_(generator=torch.Generator().manual_seed(5))
    first, again, other = (fit_value(model, windows(), settings(fit_steps=20), 4, 0.9, (-1.0, 1.0), seed=s)
                           for s in (7, 7, 8))
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.net[0].weight, other.net[0].weight)


def test_lambda_returns_match_their_recursion_written_out():
    rewards, values = torch.tensor([[1.0, 2.0]]), torch.tensor([[10.0, 20.0, 30.0]])
    g1 = 2.0 + 0.9 * (0.2 * 30.0 + 0.8 * 30.0)
    g0 = 1.0 + 0.9 * (0.2 * 20.0 + 0.8 * g1)
    torch.testing.assert_close(lambda_returns(rewards, values, 0.9, 0.8), torch.tensor([[g0, g1]]))
    # lambda = 0: one-step TD targets; lambda = 1: the discounted horizon plus the bootstrapped end.
    torch.testing.assert_close(lambda_returns(rewards, values, 0.9, 0.0), torch.tensor([[1 + 0.9 * 20, 2 + 0.9 * 30]]))
    torch.testing.assert_close(lambda_returns(rewards, values, 0.9, 1.0)[:, 0], torch.tensor([1 + 0.9 * 2 + 0.81 * 30]))


def test_the_critic_of_a_constant_reward_reaches_its_discounted_sum():
    """Whatever the actor does, every step pays REWARD: the critic's fixed point is REWARD / (1 - discount)."""
    value = fit_value(constant_reward_model(REWARD), windows(), actor_critic(fit_steps=400), 4, 0.9, (-1.0, 1.0),
                      seed=0)
    obs, _ = windows()
    torch.testing.assert_close(value(obs[:, -1]), torch.full((64,), REWARD / (1 - 0.9)), rtol=0.05, atol=0.0)


def _actions_reward_model() -> RSSM:
    """A real RSSM whose imagined rewards depend on the actions taken (its reward head reads random weights)."""
    model = constant_reward_model(0.0)
    with torch.no_grad():
        model.reward_head[-1].weight.normal_(generator=torch.Generator().manual_seed(5))
    return model


def test_the_actor_climbs_the_models_rewards_and_a_fit_is_a_function_of_its_seed():
    """The actor learns through the model's gradients: its imagined return beats the mean of random actions
    from the same states by a margin (with the gradient detached from the model it would not), and a fit is
    fixed by its inputs and seed."""
    model, horizon = _actions_reward_model(), 4
    first, actor = fit_actor_critic(model, windows(), actor_critic(actor_noise=0.0), horizon, 0.9, (-1.0, 1.0), seed=7)
    obs, actions = windows()
    normalized = (obs[:, -1] - model.obs_mean) / model.obs_std
    with torch.no_grad():
        start = model.observe_context((obs - model.obs_mean) / model.obs_std, actions)

        def imagined_return(policy) -> torch.Tensor:
            state, current, total = dict(start), normalized, torch.zeros(obs.shape[0])
            for t in range(horizon):
                current, reward, state = model.imagine_step(state, policy(current, t))
                total = total + 0.9**t * reward
            return total

        learned = imagined_return(lambda current, t: actor(current))
        generator = torch.Generator().manual_seed(11)
        random = torch.stack([imagined_return(lambda current, t: torch.rand(current.shape[0], 1, generator=generator) * 2 - 1)
                              for _ in range(16)])
    assert learned.mean() > random.mean() + 2 * random.mean(dim=1).std(), (learned.mean(), random.mean())
    again = fit_value(model, windows(), actor_critic(actor_noise=0.0), horizon, 0.9, (-1.0, 1.0), seed=7)
    other = fit_value(model, windows(), actor_critic(actor_noise=0.0, fit_steps=20), horizon, 0.9, (-1.0, 1.0), seed=8)
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.net[0].weight, other.net[0].weight)
    assert all(p.requires_grad for p in model.parameters())  # the model's own flags are restored


def test_the_planner_sees_the_discounted_value_of_where_each_sequence_ends():
    model = constant_reward_model(REWARD)
    value = fit_value(model, windows(), settings(iterations=1, fit_steps=20), 4, 0.9, (-1.0, 1.0), seed=0)
    plain, valued = LearnedDynamics(model, context=4), LearnedDynamics(model, context=4, value=value, discount=0.9)
    history = torch.randn(6, 3, generator=torch.Generator().manual_seed(1)), torch.rand(5, 1) * 2 - 1
    plain.observe(*history)
    valued.observe(*history)
    candidates = torch.rand(5, 4, 1, generator=torch.Generator().manual_seed(2)) * 2 - 1
    imagined, rewards = imagine_sequences(model, plain.state, candidates)
    with_value = valued.imagine(candidates)
    assert torch.equal(with_value[:, :-1], rewards[:, :-1])
    torch.testing.assert_close(with_value[:, -1], rewards[:, -1] + 0.9 * value(imagined[:, -1]))


def test_training_windows_are_evenly_strided_full_contexts_of_valid_steps(smoke_dataset):
    store_path, manifest_path = smoke_dataset
    store = TrajectoryStore.open(str(store_path), load_manifest(str(manifest_path)))
    arrays = store.read_episodes(0, store.num_episodes)
    obs, actions = training_windows(store, 10, context=3)
    assert obs.shape[:2] == (10, 3) and actions.shape[:2] == (10, 3)
    assert np.array_equal(obs[0].numpy(), arrays["obs"][0, :3])  # the first step with two steps behind it
    assert np.array_equal(actions[0, :2].numpy(), arrays["action"][0, :2]) and not actions[:, -1].any()
    last = int(arrays["length"][-1])
    assert np.array_equal(obs[-1].numpy(), arrays["obs"][-1, last - 3:last])  # the last valid step, not padding
    everything, _ = training_windows(store, 10 ** 9, context=3)
    assert len(everything) == sum(int(n) - 2 for n in arrays["length"])


def test_a_shared_fit_is_made_once_per_checkpoint_and_loaded_by_the_next_job(smoke_dataset, tmp_path):
    """A round's collection and its closed-loop evaluation plan with the same value: the first job fits it into the
    run's folder, the next loads that file (the same bits) instead of fitting again; another checkpoint, other
    settings or other data are another file."""
    import os

    from worldpipe.control.planners import MPPI
    from worldpipe.control.value import ValueShare, fitted_value

    store_path, manifest_path = smoke_dataset
    config = {"seed": 3, "data": {"store": str(store_path), "manifest": str(manifest_path)}}
    model, planner = constant_reward_model(REWARD), MPPI(horizon=3, discount=0.9)
    fast = settings(iterations=1, fit_steps=5, states=32)
    first = fitted_value(model, config, fast, planner, 3, (-2.0, 2.0), ValueShare(str(tmp_path), "digest-a"))
    (made,) = tmp_path.glob("value-*.pt")
    stamp = os.stat(made).st_mtime_ns
    with torch.no_grad():  # a second fit would now give other numbers: a load gives the first one's
        model.reward_head[-1].bias.fill_(-REWARD)
    again = fitted_value(model, config, fast, planner, 3, (-2.0, 2.0), ValueShare(str(tmp_path), "digest-a"))
    assert os.stat(made).st_mtime_ns == stamp and not again.training
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    fitted_value(model, config, fast, planner, 3, (-2.0, 2.0), ValueShare(str(tmp_path), "digest-b"))
    fitted_value(model, config, settings(iterations=2, fit_steps=5, states=32), planner, 3, (-2.0, 2.0),
                 ValueShare(str(tmp_path), "digest-a"))
    assert len(list(tmp_path.glob("value-*.pt"))) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_settings_are_written_out_in_full_and_a_wrong_one_is_named():
    # Shooting's settings are written without a method key, as before there was a second method: those
    # datasets' and evaluations' addresses keep their hashes.
    shooting = {"iterations": 6, "states": 4096, "candidates": 16, "fit_steps": 300, "hidden": 128,
                "learning_rate": 1e-3}
    assert value_settings({}, "value") == value_settings({"method": "shooting"}, "value") == shooting
    assert set(value_settings({}, "value")) == {f for f in ValueSettings.__dataclass_fields__}
    assert value_settings({"method": "actor_critic", "batch": 8}, "value") == {
        "method": "actor_critic", "states": 4096, "fit_steps": 2000, "batch": 8, "hidden": 128, "learning_rate": 1e-3,
        "actor_learning_rate": 3e-4, "td_lambda": 0.95, "actor_noise": 0.3, "target_update": 0.02}
    for block, message in (({"iterations": 0}, "value.iterations must be an integer >= 1, got 0"),
                           ({"states": 2.5}, "value.states must be an integer >= 1, got 2.5"),
                           ({"hidden": True}, "value.hidden must be an integer >= 1, got True"),
                           ({"learning_rate": 0}, "value.learning_rate must be a number > 0, got 0"),
                           ({"horizon": 3}, "value: 'horizon' is not a setting of method 'shooting' (its settings: "
                                            "candidates, fit_steps, hidden, iterations, learning_rate, method, states)"),
                           ({"method": "actor_critic", "candidates": 4},
                            "value: 'candidates' is not a setting of method 'actor_critic' (its settings: "
                            "actor_learning_rate, actor_noise, batch, fit_steps, hidden, learning_rate, method, states, "
                            "target_update, td_lambda)"),
                           ({"method": "critic"}, "value.method must be one of actor_critic, shooting, got 'critic'"),
                           ({"method": "actor_critic", "td_lambda": 1.5},
                            "value.td_lambda must be a number >= 0 and <= 1, got 1.5"),
                           ({"method": "actor_critic", "target_update": 0},
                            "value.target_update must be a number > 0 and <= 1, got 0"),
                           ([1, 2], "value must be a mapping of value settings, got [1, 2]")):
        with pytest.raises(ValueError) as err:
            value_settings(block, "value")
        assert str(err.value) == message


def test_a_collected_spec_carries_every_value_setting_or_is_refused():
    from worldpipe.data.spec import DatasetSpec

    base = {"name": "p-round1", "env_id": "Pendulum-v1", "policy": "random", "episodes": 2, "max_steps": 10,
            "episodes_per_shard": 2, "seed": 1}
    collector = {"round": 1, "base": "p", "experiment": "e", "run_hash": "h", "parent": {"name": "p", "spec_hash": "s"},
                 "copied_episodes": 1, "planner": {}, "context": 2, "exploration_std": 0.3}
    spec = DatasetSpec.from_dict(base)
    full = value_settings({}, "value")
    assert check_collector({**collector, "value": full}, spec)["value"] == full
    with pytest.raises(ValueError, match=r"^dataset spec key 'collector.value' must list every value setting"):
        check_collector({**collector, "value": {"iterations": 6}}, spec)
    with pytest.raises(ValueError, match=r"^dataset spec key 'collector.value'.iterations must be an integer"):
        check_collector({**collector, "value": {**full, "iterations": -1}}, spec)
    assert not math.isnan(full["learning_rate"])

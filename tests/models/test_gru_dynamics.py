"""The deterministic GRU dynamics model, reached only through the world-model interface."""

import pytest
import torch

from worldpipe.models import build_model, check_model_config

CFG = {"_target_": "worldpipe.models.gru.GRUDynamics", "embed": 8, "deter": 8, "hidden": 16}


def _batch(b=3, t=6, o=3, a=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, o, generator=g), torch.randn(b, t, a, generator=g), torch.randn(b, t, generator=g),
            torch.ones(b, t))


def test_needs_no_noise_and_returns_its_loss_terms():
    torch.manual_seed(0)
    model = build_model(CFG, 3, 1)
    assert model.noise_shape(6) is None and model.rollout_noise_shape() is None
    obs, action, reward, mask = _batch()
    sums = model(obs, action, reward, mask, None)
    assert set(sums) == set(model.loss_terms) and model.loss_terms[0] == "total"


@pytest.mark.parametrize("rollout_steps", [1, 3])
def test_masked_and_future_steps_do_not_contribute(rollout_steps):
    torch.manual_seed(0)
    model = build_model({**CFG, "rollout_steps": rollout_steps}, 3, 1)
    obs, action, reward, mask = _batch()
    mask[:, 4:] = 0
    base = model(obs, action, reward, mask, None)
    obs2, reward2 = obs.clone(), reward.clone()
    obs2[:, 4:] += 100.0
    reward2[:, 4:] += 100.0
    changed = model(obs2, action, reward2, mask, None)
    for key in base:
        torch.testing.assert_close(base[key], changed[key])


@pytest.mark.parametrize("rollout_steps", [1, 3])
def test_loss_is_a_sum_over_sequences(rollout_steps):
    torch.manual_seed(0)
    model = build_model({**CFG, "rollout_steps": rollout_steps}, 3, 1)
    obs, action, reward, mask = _batch(b=4)
    whole = model(obs, action, reward, mask, None)["total"]
    parts = [model(obs[s], action[s], reward[s], mask[s], None)["total"] for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(whole, parts[0] + parts[1])


def test_open_loop_equals_stepping_the_rollout_state_by_hand():
    torch.manual_seed(0)
    model = build_model(CFG, 3, 1)
    obs, action, _, _ = _batch(t=8)
    predicted = model.predict_open_loop(obs, action, context=3)
    assert predicted.shape == (3, 5, 3)
    state = model.observe_context(obs[:, :3], action[:, :3])
    with torch.no_grad():
        first, _, state2 = model.imagine_step(state, action[:, 2])
    torch.testing.assert_close(predicted[:, 0], first)
    assert torch.equal(state2["obs"], first)  # its own prediction is the next input


def test_learns_a_linear_system_better_than_repeating():
    torch.set_num_threads(1)  # a tiny model: extra threads only contend on a loaded 2-core machine
    torch.manual_seed(0)
    steps, batch = 12, 32
    a_mat = torch.tensor([[0.95, 0.2], [-0.2, 0.95]])
    model = build_model({**CFG, "embed": 16, "deter": 32, "hidden": 64}, 2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)

    def rollout():
        x = torch.randn(batch, 2, generator=gen)
        u = torch.randn(batch, steps, 1, generator=gen) * 0.3
        xs = []
        for t in range(steps):
            xs.append(x)
            x = x @ a_mat.T + torch.cat([u[:, t], torch.zeros(batch, 1)], dim=-1)
        return torch.stack(xs, 1), u

    for _ in range(200):
        obs, act = rollout()
        sums = model(obs, act, torch.zeros(batch, steps), torch.ones(batch, steps), None)
        opt.zero_grad()
        (sums["total"] / (batch * steps)).backward()
        opt.step()
    obs, act = rollout()
    pred = model.predict_open_loop(obs, act, context=4)
    model_err = (pred[:, 0] - obs[:, 4]).pow(2).mean()
    repeat_err = (obs[:, 3] - obs[:, 4]).pow(2).mean()
    assert model_err < 0.5 * repeat_err


def test_sequence_gru_matches_stepping_the_cell_with_gradients():
    # The training forward runs torch's sequence GRU on the cell's weights; stepping the cell by hand (what the
    # rollouts do) must give the same loss and gradients (float64: only rounding may differ).
    torch.manual_seed(0)
    model = build_model(CFG, 3, 1).double()
    obs, action, reward, mask = (x.double() for x in _batch(b=4, t=9))
    mask[0, 5:] = 0
    model(obs, action, reward, mask, None)["total"].backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    h, total = obs.new_zeros(4, 8), 0.0
    for t in range(8):
        h, next_obs, r = model._advance(h, obs[:, t], action[:, t])
        err = 0.5 * (next_obs - obs[:, t + 1]).pow(2).sum(-1) + 0.5 * (r - reward[:, t]).pow(2)
        total = total + (err * mask[:, t + 1]).sum()
    total.backward()
    for name, grad in fused.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-9, atol=1e-12, msg=name)


def _open_loop_loss_by_hand(model, obs, action, reward, mask, depths):
    """Each depth's errors from stepping the rollout interface: start t reads o_0..o_t teacher-forced, then
    predicts o_{t+1..t+depths} on its own predictions and the data's actions; the per-term sums averaged over
    depths."""
    length = obs.shape[1]
    recon = reward_sum = 0.0
    for t in range(length - 1):
        state = model.observe_context(obs[:, :t + 1], action[:, :t + 1])
        for depth in range(min(depths, length - 1 - t)):
            predicted, predicted_reward, state = model.imagine_step(state, action[:, t + depth])
            valid = mask[:, t + depth + 1]
            recon = recon + (0.5 * (predicted - obs[:, t + depth + 1]).pow(2).sum(-1) * valid).sum()
            reward_sum = reward_sum + (0.5 * (predicted_reward - reward[:, t + depth]).pow(2) * valid).sum()
    return recon / depths, reward_sum / depths


@pytest.mark.parametrize("rollout_steps", [1, 2, 4])
def test_rollout_steps_train_on_the_models_own_predictions(rollout_steps):
    # Depth j of the loss is what the planner's rollout predicts j steps past the data: the same numbers as
    # stepping observe_context/imagine_step by hand (float64), averaged over the depths.
    torch.manual_seed(0)
    model = build_model({**CFG, "rollout_steps": rollout_steps, "reward_scale": 0.5}, 3, 1).double()
    obs, action, reward, mask = (x.double() for x in _batch(b=3, t=7))
    mask[1, 5:] = 0
    sums = model(obs, action, reward, mask, None)
    recon, reward_sum = _open_loop_loss_by_hand(model, obs, action, reward, mask, rollout_steps)
    torch.testing.assert_close(sums["recon"], recon, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sums["reward"], reward_sum, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sums["total"], recon + 0.5 * reward_sum, rtol=1e-10, atol=1e-12)


def test_rollout_steps_must_be_a_positive_integer():
    problems = check_model_config({**CFG, "rollout_steps": 0})
    assert problems and problems[0][0] == "model.rollout_steps", problems
    assert check_model_config({**CFG, "rollout_steps": 5}) == []

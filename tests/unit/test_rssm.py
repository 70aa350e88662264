"""The RSSM: shapes, masking, determinism, and that it can learn."""

import torch

from worldpipe.models.rssm import RSSM, RSSMConfig

CFG = RSSMConfig(embed=8, deter=8, stoch=4, hidden=16)


def _batch(b=3, t=6, o=3, a=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, o, generator=g), torch.randn(b, t, a, generator=g), torch.randn(b, t, generator=g),
            torch.ones(b, t), torch.randn(b, t, CFG.stoch, generator=g))


def test_observe_shapes():
    model = RSSM.from_config(3, 1, CFG)
    obs, action, _, _, noise = _batch()
    states = model.observe(obs, action, noise)
    assert states["h"].shape == (3, 6, CFG.deter)
    assert states["z"].shape == (3, 6, CFG.stoch)
    assert (states["prior_std"] >= CFG.min_std).all()


def test_masked_steps_do_not_contribute():
    torch.manual_seed(0)
    model = RSSM.from_config(3, 1, CFG)
    obs, action, reward, mask, noise = _batch()
    mask[:, 4:] = 0
    base = model(obs, action, reward, mask, noise)
    obs2 = obs.clone()
    obs2[:, 4:] += 100.0  # garbage beyond the valid length (future steps cannot affect the past: causal)
    changed = model(obs2, action, reward, mask, noise)
    for key in base:
        torch.testing.assert_close(base[key], changed[key])


def test_loss_is_a_sum_over_valid_steps():
    torch.manual_seed(0)
    model = RSSM.from_config(3, 1, CFG)
    obs, action, reward, mask, noise = _batch(b=4)
    whole = model(obs, action, reward, mask, noise)
    halves = [model(obs[s], action[s], reward[s], mask[s], noise[s]) for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(whole["total"], halves[0]["total"] + halves[1]["total"])


def test_same_seed_same_output_and_noise_matters():
    obs, action, reward, mask, noise = _batch()
    torch.manual_seed(1)
    a = RSSM.from_config(3, 1, CFG)(obs, action, reward, mask, noise)["total"]
    torch.manual_seed(1)
    model = RSSM.from_config(3, 1, CFG)
    b = model(obs, action, reward, mask, noise)["total"]
    assert torch.equal(a, b)
    assert not torch.equal(b, model(obs, action, reward, mask, noise + 1)["total"])


def test_learns_a_linear_system_better_than_repeating():
    torch.manual_seed(0)
    steps, batch = 12, 32
    action = torch.randn(batch, steps, 1) * 0.5
    obs = torch.zeros(batch, steps, 2)
    obs[:, 0] = torch.randn(batch, 2)
    for t in range(1, steps):
        obs[:, t, 0] = obs[:, t - 1, 0] + 0.3 * obs[:, t - 1, 1]
        obs[:, t, 1] = 0.9 * obs[:, t - 1, 1] + action[:, t - 1, 0]
    model = RSSM.from_config(2, 1, RSSMConfig(embed=16, deter=32, stoch=4, hidden=64, free_nats=0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    mask = torch.ones(batch, steps)
    for _ in range(300):
        loss = model(obs, action, torch.zeros(batch, steps), mask, torch.randn(batch, steps, 4))["total"]
        optimizer.zero_grad()
        (loss / mask.sum()).backward()
        optimizer.step()
    predicted = model.predict_open_loop(obs, action, context=6)
    model_err = (predicted[:, 0] - obs[:, 6]).pow(2).mean()
    baseline_err = (obs[:, 5] - obs[:, 6]).pow(2).mean()
    assert model_err < 0.5 * baseline_err

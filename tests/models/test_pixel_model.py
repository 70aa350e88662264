"""PixelRSSM: frames in, frames out; categorical latents with straight-through gradients; pixel metrics; pictures."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from worldpipe.evaluate.open_loop import pixel_metrics
from worldpipe.evaluate.pictures import frame_grid, side_by_side_gif, to_frames
from worldpipe.models import ModelConfigError, build_model, flat_observations, observation_key
from worldpipe.models.pixel_rssm import PixelRSSM, gumbel_from_normal, symexp, symlog

SIZE, B, T = 16, 2, 5  # 16x16 frames keep the test in milliseconds; the layers are the same as at 64x64
CFG = {"_target_": "worldpipe.models.pixel_rssm.PixelRSSM", "image_size": SIZE, "depth": 4, "embed": 16,
       "deter": 16, "stoch": 4, "classes": 5, "hidden": 16}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, more threads only fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model() -> PixelRSSM:
    torch.manual_seed(0)
    return build_model(CFG, SIZE * SIZE * 3, 1)


def _batch():
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (B, T, SIZE, SIZE, 3), generator=g, dtype=torch.uint8)
    obs = (flat_observations({"pixels": frames}, "pixels") - 127.5) / 127.5
    return obs, torch.randn(B, T, 1, generator=g), torch.randn(B, T, generator=g), torch.ones(B, T)


def test_the_model_observes_pixels_and_keeps_its_own_normalization():
    model = _model()
    assert observation_key(CFG) == "pixels" and observation_key({"_target_": "worldpipe.models.rssm.RSSM"}) == "obs"
    model.set_normalization(np.zeros(3), np.ones(3))  # the dataset's state statistics do not apply to frames
    assert torch.all(model.obs_mean == 127.5) and torch.all(model.obs_std == 127.5)
    with pytest.raises(ModelConfigError, match="image_size 16 must"):
        build_model(CFG, 3, 1)  # a state dataset's obs_dim: one line naming the key


def test_latents_are_one_hot_with_straight_through_gradients():
    model = _model()
    obs, action, reward, mask = _batch()
    noise = torch.randn(B, *model.noise_shape(T), generator=torch.Generator().manual_seed(2))
    states = model.observe(obs, action, noise)
    z = states["z"].detach().reshape(B, T, 4, 5)
    # one-hot in value (up to the rounding of + probs - probs.detach()), soft probabilities in gradient
    assert torch.allclose(z.sum(-1), torch.ones(B, T, 4)) and torch.allclose(z, z.round(), atol=1e-6)
    sums = model(obs, action, reward, mask, noise)
    assert set(sums) == set(model.loss_terms) and all(torch.isfinite(v) for v in sums.values())
    sums["image"].backward()  # the image loss reaches the posterior only through the sampled one-hots
    assert model.posterior_head[-1].weight.grad.abs().sum() > 0
    assert model.prior_head[-1].weight.grad is None or model.prior_head[-1].weight.grad.abs().sum() == 0


def test_noise_draws_categoricals_and_zero_noise_is_the_mode():
    assert torch.equal(gumbel_from_normal(torch.zeros(3)), gumbel_from_normal(torch.zeros(3)).flip(0))
    probs = torch.tensor([[0.1, 0.7, 0.2]]).repeat(4000, 1).reshape(4000, 1, 3)
    model = _model()
    model.classes = 3
    draws = model._sample(probs, torch.randn(4000, 3, generator=torch.Generator().manual_seed(0)))
    freq = draws.detach().mean(0)
    assert torch.allclose(freq, torch.tensor([0.1, 0.7, 0.2]), atol=0.03)  # Gumbel-max: exact categorical
    assert torch.equal(model._sample(probs[:1], torch.zeros(1, 3)).detach(), torch.tensor([[0.0, 1.0, 0.0]]))
    x = torch.tensor([-50.0, -1.0, 0.0, 2.0, 300.0])
    assert torch.allclose(symexp(symlog(x)), x, rtol=1e-5)


def test_imagination_returns_frames():
    model = _model().eval()
    obs, action, _, _ = _batch()
    state = model.observe_context(obs[:, :3], action[:, :3])
    frame, reward, after = model.imagine_step(state, action[:, 2], torch.randn(B, *model.rollout_noise_shape()))
    assert frame.shape == (B, SIZE * SIZE * 3) and reward.shape == (B,) and set(after) == {"h", "z"}
    assert model.predict_open_loop(obs, action, 3).shape == (B, T - 3, SIZE * SIZE * 3)


def test_pixel_metrics_score_a_perfect_model_and_repeat_last():
    target = torch.full((2, 3, 12), 100.0)
    baseline = torch.full((2, 3, 12), 90.0)
    perfect = pixel_metrics(target.clone(), target, baseline)
    assert perfect["pixel_ratio"] == [0.0, 0.0, 0.0] and perfect["beats_baseline_first_and_last"]
    assert perfect["baseline_psnr"][0] == pytest.approx(10 * np.log10(255.0**2 / 100.0))
    # predictions outside what a frame can show are clipped before scoring
    clipped = pixel_metrics(torch.full((2, 3, 12), 1000.0), target, baseline)
    assert clipped["pixel_mse"][0] == pytest.approx((155 / 255) ** 2)
    assert not clipped["beats_baseline_first_and_last"]


def test_frame_grid_and_gif():
    from PIL import Image

    true = to_frames(np.arange(4)[:, None] * 50.0 + np.full((4, SIZE * SIZE * 3), 50.0), SIZE)  # 50..200
    imagined = to_frames(np.full((4, SIZE * SIZE * 3), 300.0), SIZE)  # clipped to 255
    grid = frame_grid(true, imagined)
    assert grid.shape[1] > grid.shape[0] and grid.dtype == np.uint8
    assert (grid == 255 - 55).any()  # the error row: |200 - 255| drawn dark on white
    gif = Image.open(io.BytesIO(side_by_side_gif(true, imagined)))
    assert gif.n_frames == 4 and gif.size[0] > 2 * gif.size[1] - 10

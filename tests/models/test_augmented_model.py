"""AugmentedModel: a plugin that draws input augmentation from the global Python, NumPy and torch generators."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worldpipe.checkpoint import capture_rng, restore_rng
from worldpipe.config.compose import compose_config
from worldpipe.models import ModelConfigError, build_model
from worldpipe.models.augmented import AugmentedModel
from worldpipe.models.noise import sample_noise

OBS, ACT, B, T = 3, 1, 4, 8


def _model(experiment: str = "smoke_augmented") -> AugmentedModel:
    cfg = compose_config([f"experiment={experiment}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, OBS, ACT)
    assert isinstance(model, AugmentedModel)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    obs, action = torch.randn(B, T, OBS, generator=g), torch.randn(B, T, ACT, generator=g)
    reward, mask = torch.randn(B, T, generator=g), torch.ones(B, T)
    mask[0, 5:] = 0
    return obs, action, reward, mask


def _loss(model: AugmentedModel) -> dict[str, torch.Tensor]:
    obs, action, reward, mask = _batch()
    noise = sample_noise(0, torch.arange(B), model.noise_shape(T), torch.Generator())
    return model(obs, action, reward, mask, noise)


def test_overlay_sizes_the_inner_model_and_the_interface_is_the_inner_ones():
    model = _model()
    inner = model.inner
    assert type(inner).__name__ == "RSSM" and inner.cfg.deter == 16  # experiment=smoke's sizes reach the inner model
    assert model.loss_terms == inner.loss_terms and model.parallel == inner.parallel
    assert model.noise_shape(T) == inner.noise_shape(T)
    assert model.rollout_noise_shape() == inner.rollout_noise_shape()
    default = compose_config(["model=augmented_rssm"]).model
    plain = compose_config(["model=rssm"]).model
    assert dict(default.inner) == dict(plain)  # the inner model is conf/model/rssm.yaml unless an overlay sizes it


def test_evaluation_is_the_inner_models_and_draws_nothing():
    model = _model().eval()
    obs, action, _, _ = _batch()
    before = capture_rng()
    torch.testing.assert_close(model.predict_open_loop(obs, action, 4), model.inner.predict_open_loop(obs, action, 4),
                               rtol=0, atol=0)
    noise = sample_noise(0, torch.arange(B), model.noise_shape(T), torch.Generator())
    eval_loss, inner_loss = _loss(model), model.inner(*_batch(), noise)
    assert all(torch.equal(eval_loss[k], inner_loss[k]) for k in model.loss_terms)
    after = capture_rng()
    assert random.getstate() == before["python"] and torch.equal(after["torch"], before["torch"])


def test_training_draws_from_each_global_generator_and_restoring_them_reproduces_the_loss():
    model = _model().train()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = capture_rng()
    first = _loss(model)["total"]
    second = _loss(model)["total"]
    assert not torch.equal(first, second)  # the streams advanced
    restore_rng(saved)
    assert torch.equal(_loss(model)["total"], first)
    for stream, reseed in (("python", lambda: random.seed(99)), ("numpy", lambda: np.random.seed(99)),
                           ("torch", lambda: torch.manual_seed(99))):
        restore_rng(saved)
        reseed()  # one stream differs from the saved state: the augmentation, and so the loss, must change
        assert not torch.equal(_loss(model)["total"], first), stream


def test_bad_settings_are_refused_naming_the_key():
    inner = {"_target_": "worldpipe.models.rssm.RSSM", "deter": 8}
    with pytest.raises(ValueError, match="model.level_jitter"):
        AugmentedModel(OBS, ACT, inner=inner, level_jitter=2.0)
    with pytest.raises(ModelConfigError, match="model.inner.detr"):
        AugmentedModel(OBS, ACT, inner={**inner, "detr": 8})

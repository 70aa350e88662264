"""Input augmentation around any world model, drawn from the per-rank global generators.

:class:`AugmentedModel` wraps an inner model (built from its own config with :func:`worldpipe.models.build_model`)
(``inner``: a model config of its own, with ``_target_``) and, in training mode only, perturbs the observations before the inner model sees them:

* a per-feature gain drawn from NumPy's global generator (``np.random``),
* a per-batch noise level drawn from Python's ``random``,
* Gaussian observation noise drawn from torch's global CPU generator.

Everything else (loss terms, rollouts, open-loop prediction, partitioning) is the inner model's. Unlike the
latent noise the trainer passes in (keyed by sample index), these draws depend on *who* draws them: each rank
has its own Python/NumPy streams, so a resume is bit-identical only if every rank gets back exactly the
generator state it saved. That makes this model the training configuration that exercises per-rank RNG
restore (``conf/model/augmented_rssm.yaml``, ``experiment=smoke_augmented``); a resume onto another world size
draws different augmentation, by design.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from worldpipe.models import ModelConfigError, build_model, check_model_config
from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel


class AugmentedModel(WorldModel):
    """An inner world model trained on observations perturbed with per-rank random noise.

    ``inner``: the inner model's config (``_target_`` plus its arguments, checked like any model config).
    ``obs_noise``: standard deviation of
    the observation noise (in normalized units) at the mean noise level. ``gain_jitter``: half-width of the
    uniform per-feature gain around 1. ``level_jitter``: half-width of the uniform per-batch factor on
    ``obs_noise`` around 1.
    """

    submodels = ("inner",)

    def __init__(self, obs_dim: int, act_dim: int, inner: Mapping[str, Any], obs_noise: float = 0.05,
                 gain_jitter: float = 0.05, level_jitter: float = 0.5):

        super().__init__(obs_dim, act_dim)
        if obs_noise < 0 or gain_jitter < 0 or not 0 <= level_jitter <= 1:
            raise ValueError("model.obs_noise and model.gain_jitter must be >= 0, model.level_jitter in [0, 1]")
        inner = dict(inner)
        problems = check_model_config(inner)
        if problems:  # the trainer's config check sees only the wrapper's own keys
            raise ModelConfigError("; ".join(f"config key '{k.replace('model.', 'model.inner.', 1)}': {p}"
                                             for k, p in problems))
        self.inner = build_model(inner, obs_dim, act_dim)
        self.obs_noise, self.gain_jitter, self.level_jitter = float(obs_noise), float(gain_jitter), float(level_jitter)
        # Instance attributes shadow the class defaults: the wrapper reports what its inner model supports.
        self.loss_terms = self.inner.loss_terms
        self.parallel: ParallelSupport = self.inner.parallel
        self.state_grows = self.inner.state_grows

    def set_normalization(self, obs_mean: Any, obs_std: Any) -> None:
        """Record the statistics here and in the inner model (which interprets its outputs with them)."""
        super().set_normalization(obs_mean, obs_std)
        self.inner.set_normalization(obs_mean, obs_std)

    # ---- training ----
    def noise_shape(self, steps: int) -> tuple[int, ...] | None:
        """The inner model's training noise (keyed by sample index, drawn by the trainer)."""
        return self.inner.noise_shape(steps)

    def forward(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor,
                noise: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The inner model's loss sums on augmented observations (augmented only in training mode)."""
        if self.training:
            obs = self.augment(obs, mask)
        return self.inner(obs, action, reward, mask, noise)

    def augment(self, obs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Perturb obs [B,T,O] at valid steps with draws from the global NumPy, Python and torch generators."""
        gain = np.random.uniform(1.0 - self.gain_jitter, 1.0 + self.gain_jitter, size=self.obs_dim)
        level = self.obs_noise * random.uniform(1.0 - self.level_jitter, 1.0 + self.level_jitter)
        # Drawn on the CPU generator whatever the device, so the stream does not depend on the accelerator.
        jitter = torch.randn(obs.shape, dtype=obs.dtype).to(obs.device)
        gain_t = torch.as_tensor(gain, dtype=obs.dtype, device=obs.device)
        return (obs * gain_t + level * jitter) * mask.unsqueeze(-1)

    # ---- rollouts and evaluation: the inner model's, unperturbed ----
    def rollout_noise_shape(self) -> tuple[int, ...] | None:
        """The inner model's per-step rollout noise."""
        return self.inner.rollout_noise_shape()

    def observe_context(self, obs: torch.Tensor, action: torch.Tensor) -> RolloutState:
        """The inner model's filtered state."""
        return self.inner.observe_context(obs, action)

    def imagine_step(self, state: RolloutState, action: torch.Tensor,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, RolloutState]:
        """The inner model's imagined step."""
        return self.inner.imagine_step(state, action, noise)

    @torch.no_grad()
    def predict_open_loop(self, obs: torch.Tensor, action: torch.Tensor, context: int,
                          noise: torch.Tensor | None = None) -> torch.Tensor:
        """The inner model's open-loop prediction."""
        return self.inner.predict_open_loop(obs, action, context, noise)

    # ---- partitioning ----
    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Any] | None:
        """The inner model's plan, with module paths under ``inner.``."""
        plan = self.inner.tensor_parallel_plan(sequence_parallel)
        return None if plan is None else {f"inner.{path}": style for path, style in plan.items()}

"""Planners: choose the next action by scoring imagined action sequences (model-predictive control).

A planner is a small, batched function of a model (the PlaNet / PETS / TD-MPC shape): it keeps a Gaussian over
action sequences [H,A], samples N candidates, asks the dynamics for their rewards in one batch, refits the
Gaussian, and after its iterations acts with the first action of the mean. The next decision starts from the
mean shifted by one step (warm start). Planners are plugins like models: ``conf/planner/*.yaml`` names the class
with ``_target_``.

Every random draw comes from the generator the caller passes in, reseeded per decision from the evaluation's
recorded stream (:mod:`worldpipe.control.episodes`), so a closed-loop evaluation reruns bit-identically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class Planner:
    """Shared settings and the warm-started action distribution; subclasses say how candidates refit it."""

    horizon: int = 15
    samples: int = 256
    iterations: int = 3
    init_std: float = 1.0
    min_std: float = 0.05
    discount: float = 0.99
    action_low: float = -1.0
    action_high: float = 1.0
    # The settings' valid ranges, (low, low inclusive, high, high inclusive), None: unbounded; read by the planner
    # config's checks (worldpipe.config.planner), so a setting that cannot work is refused before any episode.
    LIMITS: ClassVar[dict[str, tuple]] = {
        "horizon": (1, True, None, False), "samples": (1, True, None, False), "iterations": (1, True, None, False),
        "init_std": (0, False, None, False), "min_std": (0, True, None, False), "discount": (0, False, 1, True)}

    def __post_init__(self) -> None:
        self.mean: torch.Tensor | None = None

    def bounded(self, low: float, high: float) -> Planner:
        """This planner acting in [low, high] (the env's action box); the initial std scales with its width."""
        self.action_low, self.action_high = float(low), float(high)
        return self

    def reset(self, act_dim: int) -> None:
        """Forget the warm start (a new episode)."""
        self.mean = torch.zeros(self.horizon, act_dim)

    def plan(self, dynamics, generator: torch.Generator, timing: dict[str, float] | None = None) -> torch.Tensor:
        """The next action [A] from the state ``dynamics`` last observed.

        ``timing``: accumulates seconds spent asking the dynamics (``imagine``) and in the planner's own
        arithmetic (``decision``).
        """
        half_width = (self.action_high - self.action_low) / 2
        mean = self.mean.clone()
        std = torch.full_like(mean, self.init_std * half_width)
        discounts = self.discount ** torch.arange(self.horizon, dtype=torch.float32)
        for _ in range(self.iterations):
            t0 = time.perf_counter()
            noise = torch.randn(self.samples, *mean.shape, generator=generator)
            candidates = (mean + std * noise).clamp(self.action_low, self.action_high)
            t1 = time.perf_counter()
            rewards = dynamics.imagine(candidates)  # [N,H]
            t2 = time.perf_counter()
            returns = (rewards * discounts).sum(dim=1)
            mean, std = self.refit(candidates, returns, mean, std)
            std = std.clamp(min=self.min_std * half_width)
            t3 = time.perf_counter()
            if timing is not None:
                timing["imagine"] = timing.get("imagine", 0.0) + (t2 - t1)
                timing["decision"] = timing.get("decision", 0.0) + (t1 - t0) + (t3 - t2)
        self.last_plan = mean  # the whole plan [H,A] this decision acted on (its first action)
        # Warm start: the rest of this plan is where the next decision begins.
        self.mean = torch.cat([mean[1:], mean[-1:]])
        return mean[0]

    def refit(self, candidates: torch.Tensor, returns: torch.Tensor, mean: torch.Tensor,
              std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next mean and std [H,A] from candidates [N,H,A] and their returns [N]."""
        raise NotImplementedError


@dataclass
class MPPI(Planner):
    """Model-predictive path integral control: every candidate weighted by exp(return / temperature).

    ``temperature`` is in units of the returns' spread (their standard deviation over the candidates), so one
    setting serves rewards of any scale; the std is refitted from the same weights.
    """

    temperature: float = 0.1
    LIMITS: ClassVar[dict[str, tuple]] = {**Planner.LIMITS, "temperature": (0, False, None, False)}

    def refit(self, candidates, returns, mean, std):
        spread = returns.std().clamp(min=1e-6)
        weights = torch.softmax((returns - returns.max()) / (self.temperature * spread), dim=0)
        weights = weights.view(-1, 1, 1)
        new_mean = (weights * candidates).sum(dim=0)
        new_std = (weights * (candidates - new_mean).pow(2)).sum(dim=0).sqrt()
        return new_mean, new_std


@dataclass
class CEM(Planner):
    """Cross-entropy method: refit to the top ``elite_fraction`` of the candidates, smoothed by ``momentum``."""

    elite_fraction: float = 0.1
    momentum: float = 0.1
    # Two elites at least: their std is the next std.
    LIMITS: ClassVar[dict[str, tuple]] = {**Planner.LIMITS, "samples": (2, True, None, False),
                                          "elite_fraction": (0, False, 1, True), "momentum": (0, True, 1, False)}

    def refit(self, candidates, returns, mean, std):
        elites = candidates[returns.topk(max(2, round(self.elite_fraction * len(returns)))).indices]
        new_mean, new_std = elites.mean(dim=0), elites.std(dim=0)
        return (self.momentum * mean + (1 - self.momentum) * new_mean,
                self.momentum * std + (1 - self.momentum) * new_std)

"""Optimizer and learning-rate schedule of a training run."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio`` of the base learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, trainer_cfg: Mapping[str, Any], fused: bool = False,
                    **options: Any) -> torch.optim.Optimizer:
    """AdamW over every parameter (sharded parameters stay sharded); ``options`` from the parallel layout.

    ``fused`` (``numerics.fused_optimizer``): the whole step in one kernel, replacing the layout's ``foreach``.
    """
    if fused:
        options = {**{k: v for k, v in options.items() if k != "foreach"}, "fused": True}
    return torch.optim.AdamW(model.parameters(), lr=trainer_cfg["lr"], weight_decay=trainer_cfg["weight_decay"],
                             **options)


def build_scheduler(optimizer: torch.optim.Optimizer, trainer_cfg: Mapping[str, Any]) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine schedule over ``trainer.steps``; stepped once per optimizer step."""
    warmup, total, floor = trainer_cfg["warmup_steps"], trainer_cfg["steps"], trainer_cfg["min_lr_ratio"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total, floor))

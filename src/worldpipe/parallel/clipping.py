"""Gradient clipping by the global norm where the gradients are spread over ranks: tensor-parallel DTensors on
different meshes, and pipeline stages that each hold their own parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _scale(params: list[nn.Parameter], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def clip_dtensor_grads(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the norm over every parameter's whole gradient: each DTensor's norm is made whole on its own
    mesh (one scalar all-reduce per sharded mesh dimension), plain tensors count as they are."""
    from torch.distributed.tensor import DTensor

    squares = []
    for p in params:
        norm = torch.linalg.vector_norm(p.grad)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    return _scale(params, torch.stack(squares).sum().sqrt(), max_norm)


def clip_stage_grads(params: list[nn.Parameter], max_norm: float, stages_group: Any,
                     device: torch.device) -> torch.Tensor:
    """Clip by the norm over every stage's gradients (each stage holds its own; one all-reduce of squares)."""
    square = sum((torch.linalg.vector_norm(p.grad) ** 2 for p in params), torch.zeros((), device=device))
    dist.all_reduce(square, group=stages_group)
    return _scale(params, square.sqrt(), max_norm)

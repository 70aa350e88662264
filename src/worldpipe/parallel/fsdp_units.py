"""FSDP2's units: which modules ``fully_shard`` wraps below the root (the layout forecast predicts the same units)."""

from __future__ import annotations

from typing import Any

from torch import nn


def fsdp_units(module: nn.Module):
    """The modules FSDP2 wraps as units below the root: parameterized children, ModuleList entries each, except
    the children a model reads whole in its own forward (``WorldModel.whole_in_forward``: they stay with it)."""
    whole = set(getattr(module, "whole_in_forward", ()))
    for name, child in module.named_children():
        if name in whole:
            continue
        if isinstance(child, nn.ModuleList):
            yield from fsdp_units(child)
        elif any(p.requires_grad for p in child.parameters()):
            yield child


def fully_shard_units(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over ``mesh`` (None: all ranks): each parameterized child (ModuleList entries each), then the root."""
    from torch.distributed.fsdp import fully_shard

    for unit in list(fsdp_units(model)):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

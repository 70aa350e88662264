"""Wrap a model for the configured parallel strategy, and move full state in and out of it."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from worldpipe.parallel.runtime import Runtime

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def wrap_model(model: nn.Module, strategy: str, runtime: Runtime) -> nn.Module:
    """DDP or FSDP2 around the model; the plain model on one process or strategy 'none'."""
    if not runtime.distributed or strategy == "none":
        return model
    if strategy == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if strategy == "fsdp2":

        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        return model
    raise ValueError(f"parallel.strategy: unknown strategy {strategy!r}")


def unwrap(model: nn.Module) -> nn.Module:
    """The user module inside a DDP wrapper (FSDP2 modifies in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def full_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Unsharded CPU model state and optimizer state keyed by parameter name (collective under FSDP2).

    One ``get_state_dict`` call: the model's and the optimizer's separately checked the same options twice.
    """
    return get_state_dict(unwrap(model), optimizer, options=_FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full (unsharded) model and optimizer state into a possibly sharded model, on every rank."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(unwrap(model), model_state, options=options)
    set_optimizer_state_dict(unwrap(model), optimizer, optim_state, options=options)


def replica_digest(model: nn.Module, strategy: str) -> str | None:
    """SHA-256 of this rank's replica of the parameters (None when parameters are sharded).

    Replicas must agree bit for bit; the trainer records every rank's digest so this can be checked afterwards.
    """
    if strategy == "fsdp2":
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()

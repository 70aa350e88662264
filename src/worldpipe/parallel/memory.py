"""Memory per rank by tensor category (parameters, gradients, optimizer state, activations), measured from the
tensors themselves, beside the ZeRO per-parameter formulas of the layouts.

Measured: the bytes of this rank's local tensors (a DTensor counts its local shard), activations as the
distinct storages autograd saves for backward during one forward pass (parameters excluded). Not counted:
allocator caching, DDP's gradient buckets, communication buffers and temporaries freed before backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

# fp32 training with Adam: 4 bytes per parameter value, 4 per gradient, 8 of optimizer state (exp_avg, exp_avg_sq).
BYTES_PARAM, BYTES_GRAD, BYTES_ADAM = 4, 4, 8


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


@contextmanager
def saved_activations(model: nn.Module) -> Iterator[dict[int, int]]:
    """Within the block, the distinct storages autograd saves for backward during forward passes (parameters
    excluded; what a recomputation saves during backward is transient), by address."""
    param_storages = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Parameters saved for backward (FSDP2's unsharded ones included, and their views) are not activations.
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return tensor
        # Saved while backward runs (a recomputed block's forward): freed as backward proceeds, not held from the
        # forward. Torch has no public "inside backward?"; the graph task id is -1 outside one.
        if torch._C._current_graph_task_id() != -1:
            return tensor
        try:
            # A DTensor (tensor-parallel regions) holds its local shard: that is what this rank keeps.
            storage = _local(tensor).untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # a storage FSDP2 has already released: nothing held
            return tensor
        if ptr not in param_storages:
            saved[ptr] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Run one step (forward, backward, optimizer step) and return this rank's bytes per category."""
    with saved_activations(model) as saved:
        loss = loss_fn()
    loss.backward()
    optimizer.step()
    return {**state_bytes(model, optimizer), "activations": sum(saved.values())}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and per-parameter optimizer state (after a step)."""
    optim = sum(_nbytes(value) for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0)  # per-parameter tensors, not 'step'
    return {
        "parameters": sum(_nbytes(p) for p in model.parameters()),
        "gradients": sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer_state": optim,
    }


def zero_formulas(params: int, tp_sharded_params: int, ranks: int) -> dict[str, dict[str, float]]:
    """Expected bytes per rank of parameters, gradients and Adam state for each layout (no activations).

    ``params``: parameter count of the model; ``tp_sharded_params``: those a tensor-parallel plan splits
    (a row-wise layer's bias stays replicated).
    DDP replicates everything (ZeRO stage 0); FSDP2 shards all three by the rank count (ZeRO stage 3);
    tensor parallelism splits the planned weights and replicates the rest.
    """
    per_rank = {
        "ddp": params,
        "fsdp2": params / ranks,
        "tp": tp_sharded_params / ranks + (params - tp_sharded_params),
    }
    return {layout: {"parameters": count * BYTES_PARAM, "gradients": count * BYTES_GRAD,
                     "optimizer_state": count * BYTES_ADAM} for layout, count in per_rank.items()}

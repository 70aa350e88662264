"""What one forward saves for backward, measured in one process, at the shape one rank of a layout sees: the
whole model, each pipeline stage, or a tensor-parallel shard; and the rollout state of those windows.

A tensor-parallel shard is measured over torch's fake process group: one process stands in for rank 0 of the
tp ranks, the model is parallelized as the layout parallelizes it, and the collectives do nothing (their results
are wrong, their shapes right, and bytes are all that is measured here). :mod:`worldpipe.parallel.forecast`
lists the shapes it needs (:class:`ForwardShape`); ``worldpipe plan`` measures them with :func:`measure_forwards`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from worldpipe.parallel.memory import saved_activations


@dataclass(frozen=True)
class ForwardShape:
    """One forward to measure: ``rows`` windows of ``steps`` steps, cut into ``stages`` pipeline stages (the
    largest counts) or split ``tp`` ways (sequence-parallel plan with ``sp``), blocks recomputed or not."""
    rows: int
    steps: int
    stages: int = 1
    tp: int = 1
    sp: bool = False
    recompute: bool = False


@dataclass(frozen=True)
class _Dims:
    obs: int
    act: int


def _inputs(dims: _Dims, shape: ForwardShape, model: nn.Module) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    rows, steps = shape.rows, shape.steps
    noise_shape = model.noise_shape(steps) or (steps, 1)  # a deterministic model ignores its noise
    return (torch.randn(rows, steps, dims.obs), torch.randn(rows, steps, dims.act), torch.randn(rows, steps),
            torch.ones(rows, steps), torch.randn(rows, *noise_shape))


def _prepared(model: nn.Module, shape: ForwardShape) -> nn.Module:
    forward = copy.deepcopy(model)
    if shape.recompute:
        forward.enable_recompute()
    return forward


def _whole(model: nn.Module, dims: _Dims, shape: ForwardShape, mesh) -> int:
    forward = _prepared(model, shape)
    if shape.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(forward, mesh, forward.tensor_parallel_plan(sequence_parallel=shape.sp))
    with saved_activations(forward) as saved:
        forward(*_inputs(dims, shape, model))
    return sum(saved.values())


def _largest_stage(model: nn.Module, dims: _Dims, shape: ForwardShape) -> int:
    """The most any stage saves (the last stage's loss included), stage by stage on copies cut as the pipeline
    cuts the model; a stage's input arrives requiring grad, as a received one does."""
    obs, action, reward, mask, _ = _inputs(dims, shape, model)
    held, inputs = [], (obs, action)
    for stage in range(shape.stages):
        cut = _prepared(model, shape)
        module = cut.pipeline_stage(stage, shape.stages)
        with saved_activations(module) as saved:
            output = module(*inputs)
            if stage == shape.stages - 1:
                cut.pipeline_loss(output, obs, reward, mask)
        held.append(sum(saved.values()))
        inputs = (output.detach().requires_grad_(),)
    return max(held)


def _state_bytes(model: nn.Module, dims: _Dims, shape: ForwardShape) -> int:
    obs, action, *_ = _inputs(dims, shape, model)
    with torch.no_grad():
        state = model.observe_context(obs, action)
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def measure_forwards(model: nn.Module, shapes: Iterable[ForwardShape], obs_dim: int,
                     act_dim: int) -> dict[ForwardShape, tuple[int, int]]:
    """(activation bytes, rollout-state bytes) of each shape, for a model (built, unwrapped: it is not changed)
    of these input widths."""
    dims = _Dims(obs_dim, act_dim)
    out: dict[ForwardShape, tuple[int, int]] = {}
    by_tp: dict[int, list[ForwardShape]] = {}
    for shape in shapes:
        by_tp.setdefault(shape.tp, []).append(shape)
    for tp, group in sorted(by_tp.items()):
        mesh = _fake_tp_mesh(tp) if tp > 1 else None
        try:
            for shape in group:
                activations = (_largest_stage(model, dims, shape) if shape.stages > 1
                               else _whole(model, dims, shape, mesh))
                out[shape] = (activations, _state_bytes(model, dims, shape))
        finally:
            if mesh is not None:
                dist.destroy_process_group()
    return out


def _fake_tp_mesh(tp: int):
    """A 1-D mesh of ``tp`` ranks in this one process (rank 0 of them), over torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own single-process stand-in

    if dist.is_initialized():
        raise RuntimeError("measuring a tensor-parallel forward needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))

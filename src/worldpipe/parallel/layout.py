"""Parallel layouts: from ``cfg.parallel`` and the runtime, the device mesh and what the trainer must do with it.

A layout is a data-parallel strategy (``parallel.strategy``: none, ddp, fsdp2) times the model axes
``parallel.tensor_parallel`` (DTensor column/row-wise sharding of the model's plan) and
``parallel.context_parallel`` (the sequence cut in time). The world is a device mesh (dp, cp, tp) without the
model axes of degree 1, data-parallel outermost and tensor-parallel innermost:
rank = (dp_rank * cp + cp_rank) * tp + tp_rank. With both model axes (tp×cp), each cp rank's ring attention
circulates the key/value blocks of its own tp rank's heads, and FSDP2 over the flattened dp×cp ranks averages
the gradients. The trainer asks the layout

* which slice of the global batch this rank loads (``dp_rank`` of ``dp_size``: ranks of one cp×tp group load
  the same windows);
* how to wrap the model (:meth:`Layout.wrap`);
* how to cut a batch in time (:meth:`Layout.shard_batch`, cp only);
* how to scale the loss sums (:meth:`Layout.loss_scale`) so that every layout computes the gradient of the
  global mean over valid steps, and how to weigh per-rank sums when logging (:attr:`Layout.metric_weight`).

Invalid layouts are refused before any process starts by :func:`worldpipe.parallel.validation.validate_layout`
(called from ``validate_config``), with the offending key named. Clipping is in
:mod:`worldpipe.parallel.clipping`, FSDP2's units in :mod:`worldpipe.parallel.fsdp_units`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from worldpipe.parallel.clipping import clip_dtensor_grads, clip_stage_grads
from worldpipe.parallel.degrees import model_degrees, pipeline_degree
from worldpipe.parallel.fsdp_units import fully_shard_units
from worldpipe.parallel.pipeline import PipelineRunner
from worldpipe.parallel.runtime import Runtime
from worldpipe.parallel.time_partition import TimePartition
from worldpipe.parallel.wrap import wrap_model

# Batch entries with a time axis (dim 1) that a context-parallel layout cuts; everything else is per window.
TIME_KEYS = ("obs", "action", "reward", "terminated", "mask", "noise", "pixels")


@dataclass
class Layout:
    """This rank's place in the layout and what the trainer does differently because of it."""
    runtime: Runtime
    strategy: str
    dp_rank: int
    dp_size: int
    tp_size: int = 1
    cp_size: int = 1
    mesh: Any = None  # torch DeviceMesh ("dp", "tp"|"cp") when a model axis is used
    partition: Any = None  # TimePartition of this rank when cp > 1
    pp_size: int = 1  # pipeline stages (pp, dp×pp); this rank's stage is mesh coordinate "pp"
    microbatches: int = 1
    schedule: str = "gpipe"
    pipeline: Any = None  # the PipelineRunner, once wrap() cut the model (pp > 1)
    sequence_parallel: bool = False  # tp_sp: norm/residual regions hold sequence shards (Megatron)
    recompute: bool = False  # activation recomputation per block (torch.utils.checkpoint)
    _reducers: int = field(default=1, init=False)

    @property
    def describe(self) -> dict[str, int | str]:
        """Strategy and degrees, for run identity records (pipeline keys only for a pipeline)."""
        out: dict[str, int | str] = {"strategy": self.strategy, "dp": self.dp_size, "tp": self.tp_size,
                                     "cp": self.cp_size}
        if self.pp_size > 1:
            out.update(pp=self.pp_size, microbatches=self.microbatches, schedule=self.schedule)
        if self.sequence_parallel:
            out["sp"] = True
        if self.recompute:
            out["recompute"] = True
        return out

    @property
    def replicated_parameters(self) -> bool:
        """True when every rank holds the same full parameters (ddp or one process): replicas can be compared."""
        return self.strategy != "fsdp2" and self.tp_size == 1 and self.pp_size == 1

    @property
    def metric_weight(self) -> float:
        """Weight of one rank's loss sums in a sum over all ranks (tp ranks hold copies of the same sums)."""
        return 1.0 / self.tp_size

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """Optimizer options the layout needs (plain and DTensor parameters mixed: no multi-tensor kernels)."""
        fsdp_everywhere = self.strategy == "fsdp2" and self.dp_size > 1  # then every parameter is a DTensor
        return {"foreach": False} if self.tp_size > 1 and not fsdp_everywhere else {}

    def loss_scale(self, global_valid: int) -> float:
        """Factor on this rank's loss sums whose gradient, after the wrapper's averaging, is the global mean."""
        return self._reducers / global_valid

    def wrap(self, model: nn.Module) -> nn.Module:
        """Apply the layout to a built model (tensor-parallel plan or time partition first, then data parallel)."""
        rt = self.runtime
        if self.recompute:
            model.enable_recompute()
        if self.pp_size > 1:
            return self._wrap_pipeline(model)
        if self.tp_size > 1:

            plan = model.tensor_parallel_plan(sequence_parallel=True) if self.sequence_parallel else \
                model.tensor_parallel_plan()
            parallelize_module(model, self.mesh["tp"], plan)
            if self.cp_size > 1:
                model.bind_time_partition(self.partition)
            # Gradients are averaged over the ranks that hold different windows or chunks (dp, and cp).
            if self.dp_size * self.cp_size > 1:
                fully_shard_units(model, self.mesh["dp"] if self.cp_size == 1 else self.mesh["dp", "cp"]._flatten())
                self._reducers = self.dp_size * self.cp_size
            return model
        if self.cp_size > 1:
            model.bind_time_partition(self.partition)
        if not rt.distributed or self.strategy == "none":
            return model
        # Gradients are averaged over every rank the wrapper spans: all of them (cp ranks included).
        self._reducers = rt.world_size
        return fully_shard_units(model, None) if self.strategy == "fsdp2" else wrap_model(model, self.strategy, rt)

    def _wrap_pipeline(self, model: nn.Module) -> nn.Module:
        """Cut the model to this rank's stage (in place) and set up the schedule; gradients are summed over the
        stage's data-parallel replicas by the runner, so the loss scale is 1 / global valid steps."""
        stage = self.mesh.get_local_rank("pp")
        module = model.pipeline_stage(stage, self.pp_size)
        dp_group = self.mesh["dp"].get_group() if self.dp_size > 1 else None
        self.pipeline = PipelineRunner(model, module, stage, self.pp_size, self.mesh["pp"].get_group(), dp_group,
                                       self.runtime.device, self.microbatches, self.schedule)
        return model

    def forward_backward(self, loss_fn: Any, part: Mapping[str, Any], global_valid: int,
                         terms: Iterable[str]) -> dict[str, torch.Tensor]:
        """Loss sums of this rank's part of the batch, with their scaled gradient accumulated (``loss_fn``: the
        wrapped model or its compiled form). A pipeline runs its schedule over the microbatches instead."""
        if self.pipeline is not None:
            return self.pipeline.step(part["obs"], part["action"], part["reward"], part["mask"],
                                      self.loss_scale(global_valid), tuple(terms))
        sums = loss_fn(part["obs"], part["action"], part["reward"], part["mask"], part["noise"])
        # Gradient of the GLOBAL mean over valid steps, whatever the layout's wrapper averages over.
        (sums["total"] * self.loss_scale(global_valid)).backward()
        return sums

    def shard_batch(self, batch: dict) -> dict:
        """This rank's chunk in time of every time-indexed entry (cp); the batch itself otherwise."""
        if self.cp_size == 1:
            return batch
        out = dict(batch)
        for key in TIME_KEYS:
            if out.get(key) is not None:
                out[key] = self.partition.chunk(out[key], dim=1)
        return out

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; handles parameters that are DTensors on different meshes, and
        pipeline stages."""
        params = [p for p in parameters if p.grad is not None]
        if self.pp_size > 1:
            return clip_stage_grads(params, max_norm, self.mesh["pp"].get_group(), self.runtime.device)
        if self.tp_size == 1 or not params:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return clip_dtensor_grads(params, max_norm)


def build_layout(parallel_cfg: Mapping[str, Any], runtime: Runtime) -> Layout:
    """The layout of this rank (a device mesh is built, collectively, when a model axis is used)."""
    layout = _build_layout(parallel_cfg, runtime)
    layout.recompute = bool(parallel_cfg.get("recompute", False))
    return layout


def _build_layout(parallel_cfg: Mapping[str, Any], runtime: Runtime) -> Layout:
    tp, cp = model_degrees(parallel_cfg)
    strategy = str(parallel_cfg["strategy"])
    if pipeline_degree(parallel_cfg) > 1:
        return _pipeline_layout(parallel_cfg, runtime, strategy)
    inner = tp * cp
    if inner == 1:
        return Layout(runtime, strategy, runtime.rank, runtime.world_size)

    dp = runtime.world_size // inner
    # Data parallel outermost, tensor parallel innermost (the most frequent collectives on the closest ranks).
    names = ("dp", *(["cp"] if cp > 1 else []), *(["tp"] if tp > 1 else []))
    shape = (dp, *([cp] if cp > 1 else []), *([tp] if tp > 1 else []))
    mesh = init_device_mesh(runtime.device.type, shape, mesh_dim_names=names)
    partition = TimePartition(mesh["cp"].get_group(), mesh.get_local_rank("cp"), cp) if cp > 1 else None
    return Layout(runtime, strategy, mesh.get_local_rank("dp"), dp, tp_size=tp, cp_size=cp, mesh=mesh,
                  partition=partition, sequence_parallel=bool(parallel_cfg.get("sequence_parallel", False)))


def _pipeline_layout(parallel_cfg: Mapping[str, Any], runtime: Runtime, strategy: str) -> Layout:
    """Mesh (dp, pp), data parallel outermost: rank = dp_rank * pp + stage (a pipeline's stages are neighbours)."""

    pp = pipeline_degree(parallel_cfg)
    dp = runtime.world_size // pp
    mesh = init_device_mesh(runtime.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Layout(runtime, strategy, mesh.get_local_rank("dp"), dp, mesh=mesh, pp_size=pp,
                  microbatches=int(parallel_cfg.get("microbatches", 1)),
                  schedule=str(parallel_cfg.get("pipeline_schedule", "gpipe")))

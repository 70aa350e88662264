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

Invalid layouts are refused before any process starts by :func:`validate_layout` (called from
``validate_config``), with the offending key named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worldpipe.config.identity import ConfigError, to_container
from worldpipe.parallel.pipeline import PipelineRunner
from worldpipe.parallel.runtime import Runtime
from worldpipe.parallel.time_partition import TimePartition
from worldpipe.parallel.wrap import wrap_model

# Batch entries with a time axis (dim 1) that a context-parallel layout cuts; everything else is per window.
TIME_KEYS = ("obs", "action", "reward", "terminated", "mask", "noise", "pixels")
DP_STRATEGIES = ("none", "ddp", "fsdp2")


def _degrees(p: Mapping[str, Any]) -> tuple[int, int]:
    return int(p.get("tensor_parallel", 1)), int(p.get("context_parallel", 1))


def _pipeline_degree(p: Mapping[str, Any]) -> int:
    return int(p.get("pipeline_parallel", 1))


def _model_support(model_cfg: Mapping[str, Any]):
    """The model's ParallelSupport from its config, without building it (None when the class cannot be found)."""
    from hydra.utils import get_class

    try:
        cls = get_class(str(model_cfg["_target_"]))
    except Exception:  # noqa: BLE001 - an unknown class is reported by the model config check, by name
        return None
    if not hasattr(cls, "parallel_support"):  # not a WorldModel: reported by the model config check
        return None
    kwargs = {key: value for key, value in model_cfg.items() if key != "_target_"}
    return cls.parallel_support(**kwargs)


def _check_rank_count(p: Mapping[str, Any], world_size: int, dp: int, tp: int, cp: int, pp: int = 1) -> None:
    """A layout with a fixed mesh (``parallel.data_parallel`` set) gets exactly its rank count, never silently
    another mesh (dp_tp on 2 ranks would be plain tp, on 8 a 4×2 mesh)."""
    required = p.get("data_parallel")
    if required is None or dp == required:
        return
    ranks = required * tp * cp * pp
    stages = f" × pipeline_parallel={pp}" if pp > 1 else ""
    raise ConfigError(
        f"config key 'parallel.nproc_per_node': {world_size} ranks (parallel.nproc_per_node="
        f"{p.get('nproc_per_node')} × parallel.nnodes={p.get('nnodes')}; train.nproc_per_node in a pipeline config) "
        f"but the layout is a mesh of {ranks} ranks (parallel.data_parallel={required} × tensor_parallel={tp} × "
        f"context_parallel={cp}{stages}); ask for {ranks} ranks, or set parallel.data_parallel={dp} to use this mesh")


def validate_layout(cfg: Mapping[str, Any], world_size: int) -> None:
    """Refuse a parallel layout that cannot work for this model and world size; the error names the key."""
    c = to_container(cfg)
    p, model_cfg = c["parallel"], c.get("model", {})
    if _pipeline_degree(p) > 1 or int(p.get("microbatches", 1)) > 1:
        return validate_pipeline(c, world_size)
    tp, cp = _degrees(p)
    for key, value in (("tensor_parallel", tp), ("context_parallel", cp)):
        if value < 1:
            raise ConfigError(f"config key 'parallel.{key}': must be a positive integer, got {value!r}")
    if world_size % (tp * cp):
        key = "tensor_parallel" if tp > 1 else "context_parallel"
        raise ConfigError(f"config key 'parallel.{key}': degree {tp * cp} does not divide the world size {world_size}")
    dp = world_size // (tp * cp)
    _check_rank_count(p, world_size, dp, tp, cp)
    strategy = p["strategy"]
    if dp > 1 and strategy == "none":
        raise ConfigError(f"config key 'parallel.strategy': 'none' cannot synchronize {dp} data-parallel ranks; "
                          "use ddp or fsdp2")
    if tp > 1 and strategy == "ddp" and dp > 1:
        raise ConfigError("config key 'parallel.strategy': dp×tp shards the data-parallel axis with fsdp2, not ddp")
    if tp > 1 and cp > 1 and strategy != "fsdp2":
        # DDP cannot wrap tensor-parallel (DTensor) parameters: the cp ranks' gradients are reduced by FSDP2.
        raise ConfigError(f"config key 'parallel.strategy': tp×cp reduces gradients over the cp (and dp) ranks "
                          f"with fsdp2, not {strategy}")
    support = _model_support(model_cfg) if "_target_" in model_cfg else None
    if support is None:
        return
    name = str(model_cfg["_target_"]).rsplit(".", 1)[-1]
    _check_recompute(p, support, name)
    if cp > 1 and support.time_partition is None:
        raise ConfigError(f"config key 'parallel.context_parallel': model {name} has no valid time partition "
                          "(a nonlinear recurrence needs every previous state); it is batch-parallel only")
    if tp > 1 and not support.tensor_parallel:
        raise ConfigError(f"config key 'parallel.tensor_parallel': model {name} has no tensor-parallel plan")
    if tp > 1 and support.max_tensor_parallel is not None and (
            tp > support.max_tensor_parallel or support.max_tensor_parallel % tp):
        raise ConfigError(f"config key 'parallel.tensor_parallel': degree {tp} must divide the model's "
                          f"{support.max_tensor_parallel} attention heads (model.heads)")
    window = c.get("data", {}).get("window")
    if p.get("sequence_parallel"):
        _check_sequence_parallel(tp, cp, window)
    if cp > 1 and isinstance(window, int) and window % cp:
        raise ConfigError(f"config key 'data.window': {window} steps cannot be cut into {cp} equal chunks "
                          "(parallel.context_parallel)")


def _check_recompute(p: Mapping[str, Any], support: Any, name: str) -> None:
    if p.get("recompute") and not support.recompute:
        raise ConfigError(f"config key 'parallel.recompute': model {name} declares no blocks to recompute")


def _check_sequence_parallel(tp: int, cp: int, window: Any) -> None:
    """Sequence parallelism shards the tensor-parallel group's norm regions in time: it needs that group, whole
    windows (not cp's chunks), and a window that cuts into tp equal shards."""
    if tp < 2:
        raise ConfigError("config key 'parallel.sequence_parallel': shards the norm regions over the tensor-parallel "
                          "group; set parallel.tensor_parallel > 1")
    if cp > 1:
        raise ConfigError("config key 'parallel.sequence_parallel': not with context parallelism (the window is "
                          "already cut in time); use tp_cp or tp_sp")
    if isinstance(window, int) and window % tp:
        raise ConfigError(f"config key 'data.window': {window} steps cannot be cut into {tp} equal sequence shards "
                          "(parallel.sequence_parallel)")


def validate_pipeline(c: Mapping[str, Any], world_size: int) -> None:
    """Refuse a pipeline layout (pp, dp×pp) that cannot work for this model, batch and world size."""
    p, model_cfg = c["parallel"], c.get("model", {})
    pp, micro = _pipeline_degree(p), int(p.get("microbatches", 1))
    if pp < 2:
        raise ConfigError(f"config key 'parallel.microbatches': {micro} microbatches need a pipeline "
                          "(parallel.pipeline_parallel > 1); gradient accumulation is not a layout")
    if _degrees(p) != (1, 1) or p.get("sequence_parallel"):
        raise ConfigError("config key 'parallel.pipeline_parallel': a pipeline combines with data parallelism only "
                          "(set parallel.tensor_parallel=1 and parallel.context_parallel=1)")
    if world_size % pp:
        raise ConfigError(f"config key 'parallel.pipeline_parallel': {pp} stages do not divide the world size "
                          f"{world_size}")
    dp = world_size // pp
    _check_rank_count(p, world_size, dp, 1, 1, pp)
    if p["strategy"] == "fsdp2" or (dp > 1 and p["strategy"] != "ddp"):
        raise ConfigError(f"config key 'parallel.strategy': a pipeline sums each stage's gradients over its "
                          f"{dp} data-parallel replicas (ddp, or none with one), not {p['strategy']}")
    batch = c.get("trainer", {}).get("batch_size")
    if isinstance(batch, int) and batch % (dp * micro):
        raise ConfigError(f"config key 'parallel.microbatches': global batch {batch} over {dp} data-parallel "
                          f"rank(s) cannot be cut into {micro} equal microbatches (trainer.batch_size)")
    if c.get("trainer", {}).get("compile"):
        raise ConfigError("config key 'trainer.compile': a pipeline runs its stages eagerly; set it to false")
    support = _model_support(model_cfg) if "_target_" in model_cfg else None
    if support is None:
        return
    name = str(model_cfg["_target_"]).rsplit(".", 1)[-1]
    _check_recompute(p, support, name)
    if support.pipeline_blocks is None:
        raise ConfigError(f"config key 'parallel.pipeline_parallel': model {name} declares no pipeline stage "
                          "boundaries")
    if pp > support.pipeline_blocks:
        raise ConfigError(f"config key 'parallel.pipeline_parallel': {pp} stages but model {name} has "
                          f"{support.pipeline_blocks} block(s) to cut between (model.layers)")


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
            from torch.distributed.tensor.parallel import parallelize_module

            plan = model.tensor_parallel_plan(sequence_parallel=True) if self.sequence_parallel else \
                model.tensor_parallel_plan()
            parallelize_module(model, self.mesh["tp"], plan)
            if self.cp_size > 1:
                model.bind_time_partition(self.partition)
            # Gradients are averaged over the ranks that hold different windows or chunks (dp, and cp).
            if self.dp_size * self.cp_size > 1:
                _fully_shard(model, self.mesh["dp"] if self.cp_size == 1 else self.mesh["dp", "cp"]._flatten())
                self._reducers = self.dp_size * self.cp_size
            return model
        if self.cp_size > 1:
            model.bind_time_partition(self.partition)
        if not rt.distributed or self.strategy == "none":
            return model
        # Gradients are averaged over every rank the wrapper spans: all of them (cp ranks included).
        self._reducers = rt.world_size
        return _fully_shard(model, None) if self.strategy == "fsdp2" else wrap_model(model, self.strategy, rt)

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
        """Clip by the global gradient norm; handles parameters that are DTensors on different meshes."""
        params = [p for p in parameters if p.grad is not None]
        from torch.distributed.tensor import DTensor

        if self.pp_size > 1:
            return self._clip_stages(params, max_norm)
        if self.tp_size == 1 or not params:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        squares = []
        for p in params:
            norm = torch.linalg.vector_norm(p.grad)
            squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
        total = torch.stack(squares).sum().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        return total


    def _clip_stages(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (each stage holds its own; one all-reduce of squares)."""
        import torch.distributed as dist

        square = sum((torch.linalg.vector_norm(p.grad) ** 2 for p in params),
                     torch.zeros((), device=self.runtime.device))
        dist.all_reduce(square, group=self.mesh["pp"].get_group())
        total = square.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        return total


def fsdp_units(module: nn.Module):
    """The modules FSDP2 wraps as units below the root: parameterized children, ModuleList entries each."""
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            yield from fsdp_units(child)
        elif any(p.requires_grad for p in child.parameters()):
            yield child


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over ``mesh`` (None: all ranks): each parameterized child (ModuleList entries each), then the root."""
    from torch.distributed.fsdp import fully_shard

    for unit in list(fsdp_units(model)):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_layout(parallel_cfg: Mapping[str, Any], runtime: Runtime) -> Layout:
    """The layout of this rank (a device mesh is built, collectively, when a model axis is used)."""
    layout = _build_layout(parallel_cfg, runtime)
    layout.recompute = bool(parallel_cfg.get("recompute", False))
    return layout


def _build_layout(parallel_cfg: Mapping[str, Any], runtime: Runtime) -> Layout:
    tp, cp = _degrees(parallel_cfg)
    strategy = str(parallel_cfg["strategy"])
    if _pipeline_degree(parallel_cfg) > 1:
        return _pipeline_layout(parallel_cfg, runtime, strategy)
    inner = tp * cp
    if inner == 1:
        return Layout(runtime, strategy, runtime.rank, runtime.world_size)
    from torch.distributed.device_mesh import init_device_mesh

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
    from torch.distributed.device_mesh import init_device_mesh

    pp = _pipeline_degree(parallel_cfg)
    dp = runtime.world_size // pp
    mesh = init_device_mesh(runtime.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Layout(runtime, strategy, mesh.get_local_rank("dp"), dp, mesh=mesh, pp_size=pp,
                  microbatches=int(parallel_cfg.get("microbatches", 1)),
                  schedule=str(parallel_cfg.get("pipeline_schedule", "gpipe")))

"""Layout forecast: per-rank memory by category and per-step communication of each parallel layout, predicted.

The model is described once by :func:`model_facts` (parameter shapes, FSDP2 units, the tensor-parallel plan,
attention widths); everything else is arithmetic on those facts and the layout's degrees:

* parameters, gradients (fp32) and AdamW state (two fp32 tensors) per rank: a tensor-parallel plan splits
  column-wise weights and biases on dim 0 and row-wise weights on dim 1 (a row-wise bias stays replicated);
  FSDP2 then shards dim 0 of every local tensor over its ranks, padded to a multiple of them (rank 0 holds
  the padded share, the largest); DDP and single replicate everything.
* activations are **measured**, not derived: the bytes autograd saves in one single-process forward of the
  per-rank shard shape (batch/dp windows of window/cp steps), tensor-parallel plans applied over a fake process
  group, pipelines cut into their stages (:mod:`worldpipe.parallel.forward_memory`; the caller passes them in).
* KV/recurrent state is the rollout state (``observe_context``) of this rank's windows, measured the same
  way and divided by tp (attention heads are split by it).
* communication per rank and step, bytes of the tensors handed to each collective and the number of calls:
  DDP all_reduce of the gradients (rounds: DDP buckets of 1 MiB then 25 MiB, approximate when > 1 MiB);
  FSDP2 all_gather of each unit's padded parameters in forward and again in backward (the root is not
  resharded after forward) and reduce_scatter of each unit's padded gradients; tensor-parallel all_reduce
  of each row-wise module's output in forward and of each column-wise module's input gradient in backward;
  ring-attention sends of the stacked key/value block, (cp-1) in forward and cp in backward (blocks travel
  with their gradient accumulators, then the accumulators take one last hop) per attention layer.
* pipelines (pp, dp×pp): parameters, gradients and AdamW state of the largest stage (the model's own stage
  boundaries, :meth:`WorldModel.pipeline_stage`); communication of rank 0 (stage 0): its M microbatches'
  boundary activations sent forward, the data-parallel all_reduce of its stage's gradients, and the pipeline
  group's all_reduce of the gradient norm. Activations: the largest stage's forward of the per-rank windows
  (the loss on the last), times the microbatches alive at once on a stage (GPipe: all M; 1F1B: at most P) over M.
* clipping's gradient norm: one scalar all_reduce per step in a pipeline; per parameter and sharded mesh
  dimension under tensor parallelism (:func:`_gradient_norm_comm`).
* sequence parallelism (tp_sp), as DTensor runs it (measured, see :func:`_sequence_parallel_comm`): forward
  all_gather + reduce_scatter per tensor-parallel region, backward all_gathers and two whole-activation
  all_reduces per region (not Megatron's reduce_scatters). Activations: the forward of the sequence-parallel
  plan.
* recomputation (``recompute``): the activations are measured with the model's blocks recomputed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worldpipe.config.identity import ConfigError, to_container
from worldpipe.parallel.forward_memory import ForwardShape
from worldpipe.parallel.fsdp_units import fsdp_units
from worldpipe.parallel.memory import BYTES_ADAM, BYTES_GRAD, BYTES_PARAM
from worldpipe.parallel.validation import validate_layout

DDP_FIRST_BUCKET, DDP_BUCKET = 1 << 20, 25 << 20  # torch DDP's first bucket cap and bucket_cap_mb default
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "state")


@dataclass(frozen=True)
class Param:
    """One parameter: its FSDP2 unit (-1: the root), shape, and tensor-parallel style (col, row or None)."""
    unit: int
    shape: tuple[int, ...]
    tp: str | None = None
    bias: bool = False


@dataclass(frozen=True)
class ModelFacts:
    """What the predictions need to know of a model (from :func:`model_facts`)."""
    params: tuple[Param, ...]
    tp_modules: tuple[tuple[str, int, int], ...] = ()  # (style, in_features, out_features) per planned Linear
    attention_widths: tuple[int, ...] = ()  # key width of each attention layer (ring attention under cp)
    # P -> the stage of every parameter (same order as ``params``), for each pipeline depth the model allows
    stages: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    boundary_width: int | None = None  # last-axis width of what one stage hands the next
    blocks: int | None = None  # the blocks the stages are cut between


@dataclass(frozen=True)
class Degrees:
    """A layout on a world size: strategy and the dp, tp, cp (and pp) degrees, and the per-layout options."""
    strategy: str
    dp: int
    tp: int
    cp: int
    pp: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    sp: bool = False
    recompute: bool = False

    @property
    def grad_sync(self) -> tuple[str, int]:
        """How gradients are synchronized (``fsdp``, ``ddp``, ``stage`` or ``none``) and over how many ranks (as
        Layout.wrap)."""
        if self.pp > 1:
            return ("stage", self.dp) if self.dp > 1 else ("none", 1)
        if self.tp > 1:
            return ("fsdp", self.dp * self.cp) if self.dp * self.cp > 1 else ("none", 1)
        ranks = self.dp * self.cp
        if ranks == 1 or self.strategy == "none":
            return "none", 1
        return ("fsdp" if self.strategy == "fsdp2" else "ddp"), ranks


@dataclass
class Prediction:
    """One layout's prediction, or the reason it is ruled out."""
    name: str
    degrees: Degrees | None = None
    memory: dict[str, int] = field(default_factory=dict)
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    refused: str | None = None

    @property
    def total_bytes(self) -> int:
        """Predicted bytes per rank, all categories."""
        return sum(self.memory.values())

    @property
    def comm_bytes(self) -> int:
        """Predicted bytes handed to collectives per rank and step."""
        return sum(c["bytes"] for c in self.comm.values())


def model_facts(model: nn.Module) -> ModelFacts:
    """Parameter shapes by FSDP2 unit, the tensor-parallel plan's Linear modules, and the attention layers'
    key widths (modules with ``head_dim`` and a ``key`` Linear) of a built, unwrapped model."""
    units = {id(p): index for index, unit in enumerate(fsdp_units(model)) for p in unit.parameters()}
    styles: dict[str, str] = {}
    tp_modules = []
    if getattr(getattr(model, "parallel", None), "tensor_parallel", False):
        from torch.distributed.tensor.parallel import ColwiseParallel

        modules = dict(model.named_modules())
        for path, style in model.tensor_parallel_plan().items():
            kind = "col" if isinstance(style, ColwiseParallel) else "row"
            styles[path] = kind
            tp_modules.append((kind, modules[path].in_features, modules[path].out_features))
    params = []
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        params.append(Param(units.get(id(p), -1), tuple(p.shape), styles.get(owner), leaf == "bias"))
    widths = tuple(m.key.out_features for m in model.modules()
                   if hasattr(m, "head_dim") and isinstance(getattr(m, "key", None), nn.Linear))
    blocks = getattr(getattr(model, "parallel", None), "pipeline_blocks", None)
    stages, boundary = _pipeline_facts(model, blocks)
    return ModelFacts(tuple(params), tuple(tp_modules), widths, stages, boundary, blocks)


def _pipeline_facts(model: nn.Module, blocks: int | None) -> tuple[dict[int, tuple[int, ...]], int | None]:
    """The stage of every parameter for P = 2..blocks (the model cuts a copy of itself), and the boundary width."""
    if not blocks or blocks < 2:
        return {}, None

    names = [name for name, _ in model.named_parameters()]
    stages, boundary = {}, None
    for depth in range(2, min(blocks, 8) + 1):
        owner = {}
        for stage in range(depth):
            cut = copy.deepcopy(model)
            module = cut.pipeline_stage(stage, depth)
            owner.update({name: stage for name, _ in cut.named_parameters()})
            if stage == 0 and boundary is None:
                with torch.no_grad():
                    out = module(torch.zeros(1, 2, model.obs_dim), torch.zeros(1, 2, model.act_dim))
                boundary = int(out.shape[-1])
        stages[depth] = tuple(owner[name] for name in names)
    return stages, boundary


def _tp_local(p: Param, tp: int) -> tuple[int, ...]:
    if tp == 1 or p.tp is None or (p.tp == "row" and p.bias):
        return p.shape
    if p.tp == "col":
        return (p.shape[0] // tp, *p.shape[1:])
    return (p.shape[0], p.shape[1] // tp, *p.shape[2:])


def _padded(shape: tuple[int, ...], ranks: int) -> tuple[int, int]:
    """(this rank's padded shard numel, the padded full numel) of dim-0 sharding over ``ranks``."""
    rest = math.prod(shape[1:])
    rows = math.ceil(shape[0] / ranks) if shape else 1
    return rows * rest, rows * ranks * rest


def parameters_per_rank(facts: ModelFacts, d: Degrees) -> int:
    """Parameter values this rank holds (rank 0: the largest FSDP2 share)."""
    if d.pp > 1:  # the largest stage
        sizes = [0] * d.pp
        for p, stage in zip(facts.params, facts.stages[d.pp], strict=True):
            sizes[stage] += math.prod(p.shape)
        return max(sizes)
    kind, ranks = d.grad_sync
    total = 0
    for p in facts.params:
        local = _tp_local(p, d.tp)
        total += _padded(local, ranks)[0] if kind == "fsdp" else math.prod(local)
    return total


def predict_memory(facts: ModelFacts, d: Degrees, activations: int, state: int) -> dict[str, int]:
    """Bytes per rank by category; ``activations`` and ``state`` measured at the per-rank shard shape."""
    count = parameters_per_rank(facts, d)
    return {"parameters": count * BYTES_PARAM, "gradients": count * BYTES_GRAD,
            "optimizer_state": count * BYTES_ADAM, "activations": activations, "state": state // d.tp}


def _ddp_rounds(nbytes: int) -> int:
    return 1 if nbytes <= DDP_FIRST_BUCKET else 1 + math.ceil((nbytes - DDP_FIRST_BUCKET) / DDP_BUCKET)


def _grad_sync_comm(facts: ModelFacts, d: Degrees) -> dict[str, dict[str, int]]:
    kind, ranks = d.grad_sync
    if kind == "stage":  # rank 0's stage, summed over its replicas in one flattened call
        nbytes = sum(math.prod(p.shape) for p, s in zip(facts.params, facts.stages[d.pp], strict=True) if s == 0)
        return {"all_reduce(stage gradients)": {"bytes": nbytes * BYTES_GRAD, "rounds": 1}}
    if kind == "ddp":
        nbytes = sum(math.prod(p.shape) for p in facts.params) * BYTES_GRAD
        return {"all_reduce(gradients)": {"bytes": nbytes, "rounds": _ddp_rounds(nbytes)}}
    if kind != "fsdp":
        return {}
    unit_bytes: dict[int, int] = {}
    for p in facts.params:
        unit_bytes[p.unit] = unit_bytes.get(p.unit, 0) + _padded(_tp_local(p, d.tp), ranks)[1] * BYTES_PARAM
    regathered = {u: b for u, b in unit_bytes.items() if u != -1}  # the root stays unsharded after forward
    return {"all_gather(parameters)": {"bytes": sum(unit_bytes.values()) + sum(regathered.values()),
                                       "rounds": len(unit_bytes) + len(regathered)},
            "reduce_scatter(gradients)": {"bytes": sum(unit_bytes.values()), "rounds": len(unit_bytes)}}


def predict_comm(facts: ModelFacts, d: Degrees, batch: int, window: int) -> dict[str, dict[str, int]]:
    """Bytes and calls per collective on one rank in one training step (``batch`` windows in all)."""
    comm = _grad_sync_comm(facts, d)
    tokens = (batch // d.dp) * (window // d.cp)
    if d.pp > 1:
        comm["send(stage activations)"] = {"bytes": tokens * facts.boundary_width * BYTES_PARAM,
                                           "rounds": d.microbatches}
    comm.update(_gradient_norm_comm(facts, d))
    if d.tp > 1 and d.sp:
        comm.update(_sequence_parallel_comm(facts, d, tokens))
    elif d.tp > 1:
        rows = [out for style, _, out in facts.tp_modules if style == "row"]
        rows += rows[:_recomputed_regions(facts, d)]
        cols = [inp for style, inp, _ in facts.tp_modules if style == "col"]
        comm["all_reduce(activations)"] = {"bytes": tokens * (sum(rows) + sum(cols)) * BYTES_PARAM,
                                           "rounds": len(rows) + len(cols)}
    if d.cp > 1 and facts.attention_widths:
        blocks = [2 * tokens * (width // d.tp) * BYTES_PARAM for width in facts.attention_widths]  # K and V
        forward = (d.cp - 1) * (2 if d.recompute else 1)  # recomputed: the forward ring runs again
        comm["send(kv ring)"] = {"bytes": sum((forward + 2 * (d.cp - 1)) * kv + kv for kv in blocks),
                                 "rounds": len(blocks) * (forward + d.cp)}
    return comm


def _gradient_norm_comm(facts: ModelFacts, d: Degrees) -> dict[str, dict[str, int]]:
    """Clipping's norm (``Layout.clip_grad_norm``): a pipeline all-reduces its stages' squared norm once; with
    tensor parallelism every parameter's norm is made whole, one scalar all-reduce per mesh dimension its
    gradient is sharded over (FSDP2's dp/cp ranks, the tp ranks). Plain tensors (single, ddp, cp) need none;
    nor does FSDP2 alone, whose torch ``clip_grad_norm_`` leaves the norm a partial DTensor (measured)."""
    if d.pp > 1:
        return {"all_reduce(gradient norm)": {"bytes": BYTES_PARAM, "rounds": 1}}
    if d.tp == 1:
        return {}
    fsdp = d.grad_sync[0] == "fsdp"
    rounds = sum(int(fsdp) + int(_tp_local(p, d.tp) != p.shape) for p in facts.params)
    return {"all_reduce(gradient norm)": {"bytes": rounds * BYTES_PARAM, "rounds": rounds}} if rounds else {}


def _recomputed_regions(facts: ModelFacts, d: Degrees) -> int:
    """Row-wise outputs reduced again when blocks are recomputed: non-reentrant checkpointing stops once the
    tensors backward needs exist, so each block's last region (its output) is not recomputed."""
    if not d.recompute:
        return 0
    rows = sum(1 for style, _, _ in facts.tp_modules if style == "row")
    return rows - (facts.blocks or 0)


def _sequence_parallel_comm(facts: ModelFacts, d: Degrees, tokens: int) -> dict[str, dict[str, int]]:
    """tp_sp as DTensor runs it, per region R (a row-wise output): forward, an all_gather of its input and a
    reduce_scatter of its output (plus the final norm's gather); backward, an all_gather of each output's
    gradient (plus the embedding's), and two all_reduces of whole activation gradients per region where
    Megatron would reduce-scatter. All_gather bytes are the shard handed in, the others the whole tensor."""
    widths = [out for style, _, out in facts.tp_modules if style == "row"]
    regions, full = len(widths), tokens * max(widths) * BYTES_PARAM
    again = _recomputed_regions(facts, d)
    gathers = 2 * regions + 2 + (regions if d.recompute else 0)  # every region's input is gathered again
    return {"all_gather(activations)": {"bytes": gathers * full // d.tp, "rounds": gathers},
            "reduce_scatter(activations)": {"bytes": (regions + again) * full, "rounds": regions + again},
            "all_reduce(activations)": {"bytes": 2 * regions * full, "rounds": 2 * regions}}


def pipeline_activations(largest_stage: int, d: Degrees) -> int:
    """Activations of the microbatches alive at once on a stage, from the largest stage's forward of all of this
    rank's windows (GPipe: every microbatch's; 1F1B: at most P of M)."""
    alive = d.microbatches if d.schedule == "gpipe" else min(d.microbatches, d.pp)
    return int(largest_stage * alive / d.microbatches)


def degrees(parallel_cfg: Mapping[str, Any], world_size: int) -> Degrees:
    """The layout's degrees on ``world_size`` ranks (after :func:`validate_layout` accepted it)."""
    tp, cp = int(parallel_cfg.get("tensor_parallel", 1)), int(parallel_cfg.get("context_parallel", 1))
    pp = int(parallel_cfg.get("pipeline_parallel", 1))
    return Degrees(str(parallel_cfg["strategy"]), world_size // (tp * cp * pp), tp, cp, pp,
                   int(parallel_cfg.get("microbatches", 1)), str(parallel_cfg.get("pipeline_schedule", "gpipe")),
                   bool(parallel_cfg.get("sequence_parallel", False)), bool(parallel_cfg.get("recompute", False)))


def forward_shape(d: Degrees, windows: int, steps: int) -> ForwardShape:
    """The forward whose saved bytes are one rank's activations under ``d``, at (windows, steps)."""
    return ForwardShape(windows, steps, stages=d.pp, tp=d.tp, sp=d.sp, recompute=d.recompute)


def _refusal(c: Mapping[str, Any], parallel: Mapping[str, Any], world_size: int) -> str | None:
    """Why the layout cannot run this config on ``world_size`` ranks (the layout check's reason), or None."""
    # The world size asked for, on one node (not the layout file's own rank count), as the refusal says.
    asked = {**parallel, "nproc_per_node": world_size, "nnodes": 1}
    try:
        validate_layout({**c, "parallel": asked}, world_size)
    except ConfigError as err:
        return str(err)
    batch, dp = int(c["trainer"]["batch_size"]), degrees(parallel, world_size).dp
    if batch % dp:
        return f"config key 'trainer.batch_size': {batch} windows do not split over {dp} data-parallel ranks"
    return None


def plan(cfg: Mapping[str, Any], layouts: Mapping[str, Mapping[str, Any]], world_size: int, facts: ModelFacts,
         measured: Mapping[ForwardShape, tuple[int, int]]) -> list[Prediction]:
    """Predict every layout of ``layouts`` (name -> parallel config) for ``cfg``'s model, data and trainer.

    ``measured`` maps a forward (:class:`ForwardShape`) to its measured (activation bytes, state bytes); the
    caller measures the forwards :func:`shard_shapes` lists (with
    :func:`worldpipe.parallel.forward_memory.measure_forwards`). A layout that cannot run is kept with its reason.
    """
    c = to_container(cfg)
    batch, window = int(c["trainer"]["batch_size"]), int(c["data"]["window"])
    out = []
    for name, parallel in layouts.items():
        refused = _refusal(c, parallel, world_size)
        if refused is not None:
            out.append(Prediction(name, refused=refused))
            continue
        d = degrees(parallel, world_size)
        activations = measured[forward_shape(d, batch // d.dp, window // d.cp)][0]
        if d.pp > 1:
            activations = pipeline_activations(activations, d)
        state = measured[ForwardShape(batch // d.dp, window)][1]  # rollouts hold the whole window
        out.append(Prediction(name, d, predict_memory(facts, d, activations, state),
                              predict_comm(facts, d, batch, window)))
    return out


def shard_shapes(cfg: Mapping[str, Any], layouts: Mapping[str, Mapping[str, Any]],
                 world_size: int) -> set[ForwardShape]:
    """The forwards :func:`plan` needs measured: those of the layouts that can run."""
    c = to_container(cfg)
    batch, window = int(c["trainer"]["batch_size"]), int(c["data"]["window"])
    shapes = set()
    for parallel in layouts.values():
        if _refusal(c, parallel, world_size) is None:
            d = degrees(parallel, world_size)
            shapes |= {forward_shape(d, batch // d.dp, window // d.cp), ForwardShape(batch // d.dp, window)}
    return shapes


def rank(predictions: list[Prediction], budget_bytes: int | None) -> list[Prediction]:
    """Layouts that run and fit the budget, least communication first (then least memory); others after,
    each with its reason (over budget, or why it cannot run)."""
    fits, others = [], []
    for p in predictions:
        if p.refused is None and budget_bytes is not None and p.total_bytes > budget_bytes:
            p.refused = f"needs {p.total_bytes / 2**20:.3f} MiB per rank, over the budget of {budget_bytes / 2**20:.4g} MiB"
        (others if p.refused else fits).append(p)
    return sorted(fits, key=lambda p: (p.comm_bytes, p.total_bytes)) + others


def as_dict(p: Prediction) -> dict[str, Any]:
    """A prediction as JSON-ready data."""
    d = p.degrees
    return {"layout": p.name, "fits": p.refused is None, "reason": p.refused,
            "degrees": None if d is None else {"strategy": d.strategy, "dp": d.dp, "tp": d.tp, "cp": d.cp,
                                               "pp": d.pp, "sp": d.sp, "recompute": d.recompute},
            "memory_bytes": p.memory, "total_bytes": p.total_bytes if p.memory else None,
            "comm": p.comm, "comm_bytes": p.comm_bytes if p.memory else None}


def table(ranked: list[Prediction]) -> str:
    """The ranked layouts as a text table (KiB per rank; communication per step), then the ruled-out ones."""
    head = (f"{'#':>2} {'layout':8} {'dp×tp×cp×pp':11} " + " ".join(f"{c[:9]:>9}" for c in CATEGORIES)
            + f" {'total':>9}  communication per step (KiB, calls)")
    lines = ["memory per rank in KiB (" + ", ".join(CATEGORIES) + ")", head]
    for i, p in enumerate(x for x in ranked if x.refused is None):
        d = p.degrees
        comm = "; ".join(f"{k} {v['bytes'] / 1024:.1f}×{v['rounds']}" for k, v in p.comm.items()) or "none"
        lines.append(f"{i + 1:>2} {p.name:8} {f'{d.dp}×{d.tp}×{d.cp}×{d.pp}':11} "
                     + " ".join(f"{p.memory[c] / 1024:9.1f}" for c in CATEGORIES)
                     + f" {p.total_bytes / 1024:9.1f}  {comm}")
    lines += [f"   {p.name:8} ruled out: {p.refused}" for p in ranked if p.refused is not None]
    return "\n".join(lines)

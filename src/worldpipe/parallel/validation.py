"""The layout checks: refuse, before any process starts, a parallel layout that cannot work for this model,
batch and world size, naming the config key (called from ``validate_config`` and by the layout forecast).

The model is asked for its :class:`ParallelSupport` (by class, from its config, without building it): nothing
here branches on a model's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.config.identity import ConfigError, to_container
from worldpipe.parallel.degrees import model_degrees, pipeline_degree


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
    if pipeline_degree(p) > 1 or int(p.get("microbatches", 1)) > 1:
        return validate_pipeline(c, world_size)
    tp, cp = model_degrees(p)
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
    pp, micro = pipeline_degree(p), int(p.get("microbatches", 1))
    if pp < 2:
        raise ConfigError(f"config key 'parallel.microbatches': {micro} microbatches need a pipeline "
                          "(parallel.pipeline_parallel > 1); gradient accumulation is not a layout")
    if model_degrees(p) != (1, 1) or p.get("sequence_parallel"):
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

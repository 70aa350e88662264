"""Typed schemas of the training config groups (Hydra structured configs).

Each group's YAML files in ``conf/`` start from its schema (``defaults: [schema, _self_]``), so Hydra rejects
unknown keys and values of the wrong type while composing, naming the key. Ranges live beside the types, as
field metadata (``ge``/``gt``/``le``/``choices``, or ``check``: a function that names what is wrong with a
value of a syntax of its own, like a URI), and :func:`check_ranges` enforces them; only checks that span
several keys stay hand-written, in :func:`worldpipe.trainer.validation.validate_config`.

The ``model`` group has no schema here: each model's constructor signature is its schema
(:func:`worldpipe.models.check_model_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from worldpipe.config.tracking_uri import tracking_uri_problem

STRATEGIES = ("none", "ddp", "fsdp2")
VERIFY_MODES = ("size", "sha256", "first")
NUMERICS_MODES = ("native", "portable")


def _range(default: Any, **bounds: Any) -> Any:
    return field(default=default, metadata=bounds)


@dataclass
class DataConfig:
    """Which trajectory store to train on and how to cut it into windows."""

    name: str = MISSING
    store: str = MISSING
    manifest: str = MISSING
    window: int = _range(32, ge=2)  # the model predicts the next step: at least two steps
    stride: int = _range(8, gt=0)
    cache_mb: int = _range(256, ge=0)
    prefetch: int = _range(2, ge=0)


@dataclass
class TrainerConfig:
    """Optimization: steps, global batch, schedule, logging cadence, determinism."""

    steps: int = _range(3000, gt=0)
    batch_size: int = _range(16, gt=0)  # GLOBAL windows per step, independent of the world size
    lr: float = _range(1.0e-3, gt=0)
    weight_decay: float = _range(0.0, ge=0)
    warmup_steps: int = _range(100, ge=0)
    min_lr_ratio: float = _range(0.1, ge=0, le=1)
    grad_clip: float = _range(100.0, gt=0)
    log_every: int = _range(10, gt=0)
    threads_per_rank: int = _range(1, ge=1)
    deterministic: bool = True
    progress_bar: bool = True
    compile: bool = False  # torch.compile the loss (opt-in): other bits than eager, reproducible with itself


@dataclass
class ParallelConfig:
    """How many processes, on how many nodes, and how the model is partitioned over them."""

    strategy: str = _range("ddp", choices=STRATEGIES)
    nproc_per_node: int = _range(2, ge=1)
    nnodes: int = _range(1, ge=1)
    backend: str = _range("auto", choices=("auto", "gloo", "nccl"))
    even_batches: bool = True
    rdzv_timeout_s: int | None = _range(None, gt=0)  # start-up rendezvous limit; None: the launcher's default
    tensor_parallel: int = _range(1, ge=1)  # DTensor column/row-wise degree (worldpipe.parallel.layout)
    context_parallel: int = _range(1, ge=1)  # ranks a sequence is cut over in time
    # Megatron sequence parallelism inside the tensor-parallel group: norms and the residual stream hold sequence
    # shards (tp_sp); needs tensor_parallel > 1
    sequence_parallel: bool = False
    # Activation recomputation, any layout: each block keeps only its input for backward and recomputes the rest
    # (models that declare blocks); less activation memory for about one more forward per step
    recompute: bool = False
    pipeline_parallel: int = _range(1, ge=1)  # pipeline stages the model is cut into (models with stage boundaries)
    microbatches: int = _range(1, ge=1)  # a pipeline's microbatches per data-parallel rank and step
    pipeline_schedule: str = _range("gpipe", choices=("gpipe", "1f1b"))
    # Data-parallel degree a layout with a fixed mesh requires (tp, cp, dp_tp, ...): the world size must then be
    # exactly data_parallel × tensor_parallel × context_parallel. None: as many data-parallel ranks as the world
    # size leaves (ddp, fsdp2 scale to any rank count).
    data_parallel: int | None = _range(None, ge=1)


@dataclass
class CheckpointConfig:
    """Where and how often the state is published, how much is kept, how loads verify."""

    dir: str = MISSING
    every: int = _range(250, gt=0)
    keep_last: int = _range(2, ge=2)  # one checkpoint is no fallback when the newest is corrupt
    keep_every: int | None = _range(None, gt=0)
    async_save: bool = False
    verify: str = _range("first", choices=VERIFY_MODES)
    allow_config_change: bool = False


@dataclass
class TrackingConfig:
    """The MLflow run of a training run."""

    enabled: bool = True
    uri: str | None = _range(None, check=tracking_uri_problem)  # its syntax, before any process starts
    experiment: str = "worldpipe"
    run_name: str = MISSING
    system_metrics_interval_s: float = _range(1.0, ge=0)  # MLflow system metrics from rank 0; 0: off
    system_metrics_samples_before_logging: int = _range(1, ge=1)  # samples averaged into each logged point
    register_as: str | None = None  # model registry name of the evaluated model (worldpipe evaluate)


@dataclass
class NumericsConfig:
    """Which code paths decide the floating-point bits (:mod:`worldpipe.core.numerics`).

    ``native``: this machine's fastest paths, as the libraries choose them (bits depend on the CPU type).
    ``portable``: the paths pinned below, set in every process before its first kernel, so that any x86 CPU
    with AVX2 and FMA gives the same bits (at a measured cost; docs/numerics.md).
    """

    mode: str = _range("native", choices=NUMERICS_MODES)
    mkl_cbwr: str | None = None              # MKL_CBWR, e.g. COMPATIBLE
    aten_cpu_capability: str | None = _range(None, choices=("default", "avx2", "avx512"))  # ATEN_CPU_CAPABILITY
    onednn_max_cpu_isa: str | None = None    # ONEDNN_MAX_CPU_ISA, e.g. AVX2
    # The optimizer's step as one fused kernel with exact square roots: the unfused step's sqrt runs MKL's vector
    # math, whose results differ between CPU vendors even on MKL's compatible path (measured: AMD vs Intel).
    fused_optimizer: bool = False


GROUP_SCHEMAS: dict[str, type] = {
    "data": DataConfig,
    "trainer": TrainerConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "tracking": TrackingConfig,
    "numerics": NumericsConfig,
}
SCHEMA_NAME = "schema"  # conf/<group>/*.yaml list it first in their defaults


def register_schemas() -> None:
    """Make ``<group>/schema`` known to Hydra (idempotent; runs when this module is imported)."""
    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name=SCHEMA_NAME, node=schema)


def _violation(value: Any, bounds: dict[str, Any]) -> str | None:
    if value is None:
        return None
    if "check" in bounds:  # a value with a syntax of its own (a URI): the check says what is wrong
        return bounds["check"](value)
    if "choices" in bounds and value not in bounds["choices"]:
        return f"must be one of {bounds['choices']}, got {value!r}"
    for name, test, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                             ("le", lambda v, b: v <= b, "<=")):
        if name in bounds and not test(value, bounds[name]):
            return f"must be {text} {bounds[name]}, got {value!r}"
    return None


def check_ranges(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, problem) for every group value outside its schema's range, in schema order."""
    problems = []
    for group, schema in GROUP_SCHEMAS.items():
        values = config.get(group) or {}
        for spec in fields(schema):
            problem = _violation(values.get(spec.name), dict(spec.metadata))
            if problem:
                problems.append((f"{group}.{spec.name}", problem))
    return problems


register_schemas()

"""What a run is: the identity part of its resolved config (hash, resume-safe keys, diff) and its full identity.

The identity (config and hash, dataset hash, code and package versions, layout, MLflow run id) is stored in every
checkpoint and recorded in MLflow; a resume may change only the resume-safe keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from worldpipe.core import provenance
from worldpipe.core.errors import UsageError
from worldpipe.core.hashing import canonical_hash

# Keys that may change between an interrupted run and its resume without changing what is computed for the
# steps already taken: how long to train, how often to save or log, where to record, how many ranks share the
# (world-size-invariant) global batch and how they are laid out.
RESUME_SAFE_KEYS: tuple[str, ...] = (
    "planner.",  # closed-loop control's planner (a group training does not read)
    "trainer.steps",
    "trainer.log_every",
    "trainer.progress_bar",
    "trainer.threads_per_rank",
    "checkpoint.every",
    "checkpoint.keep_last",
    "checkpoint.keep_every",
    "checkpoint.async_save",
    "checkpoint.verify",
    "checkpoint.allow_config_change",
    "checkpoint.dir",
    "data.store",
    "data.manifest",
    "data.cache_mb",
    "data.prefetch",
    # The layout (strategy, degrees, rank counts): every layout computes the same global-mean gradient of the
    # same global batch, so changing it changes only floating-point reduction order.
    "parallel.",
    "tracking.",
    "paths.",
    "run_dir",
)

class ConfigError(UsageError, ValueError):
    """A config value that cannot work; the message names the key."""


def to_container(cfg: DictConfig | Mapping) -> dict:
    """Plain resolved dict of a config."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _is_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in RESUME_SAFE_KEYS)


def is_resume_safe(key: str) -> bool:
    """True for a dotted key a resume may change (RESUME_SAFE_KEYS): not part of the config hash.

    A config group all of whose keys are safe is safe as a whole: ``parallel=tp`` picks another layout.
    """
    return _is_safe(key) or f"{key}." in RESUME_SAFE_KEYS


def identity_config(cfg: DictConfig | Mapping) -> dict[str, Any]:
    """The flattened config without resume-safe keys: what must not change across a resume."""
    return {key: value for key, value in flatten(to_container(cfg)).items() if not _is_safe(key)}


def config_hash(cfg: DictConfig | Mapping) -> str:
    """SHA-256 of the identity part of the config (canonical JSON)."""
    return canonical_hash(identity_config(cfg))


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Readable lines `key: old -> new` for flattened configs (missing keys shown as <absent>)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, "<absent>"), new.get(key, "<absent>")
        if before != after:
            lines.append(f"  {key}: {before!r} -> {after!r}")
    return lines


def run_identity(cfg, dataset_hash: str, world_size: int, strategy: str, mlflow_run_id: str | None) -> dict:
    """Everything that says which run a checkpoint belongs to (stored in every checkpoint and in MLflow)."""
    return {
        "config": to_container(cfg),
        "config_hash": config_hash(cfg),
        "dataset_hash": dataset_hash,
        "code_version": provenance.code_version(),
        "versions": provenance.package_versions(),
        "lock_hash": provenance.lock_hash(),
        "world_size": world_size,
        "parallel_layout": {"strategy": strategy, "world_size": world_size},
        "mlflow_run_id": mlflow_run_id,
    }

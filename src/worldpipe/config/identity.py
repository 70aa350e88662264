"""Validation, hashing and diffing of the resolved training config.

Validation runs before any work starts (no process group, no data read), and every error names the key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from worldpipe.config.schema import check_ranges

# Keys that may change between an interrupted run and its resume without changing what is computed for the
# steps already taken: how long to train, how often to save or log, where to record, how many ranks share the
# (world-size-invariant) global batch and how they are laid out.
RESUME_SAFE_KEYS: tuple[str, ...] = (
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

class ConfigError(ValueError):
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


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"config key '{key}': {message}")


def validate_config(cfg: DictConfig | Mapping, world_size: int) -> None:
    """Check the training config for the given world size; raise ConfigError naming the bad key.

    Types and single-key ranges come from the group schemas (:mod:`worldpipe.config.schema`); the checks that
    relate several keys (or the world size) are here, once.
    """
    c = to_container(cfg)
    for key, problem in check_ranges(c):
        raise ConfigError(f"config key '{key}': {problem}")
    from worldpipe.models import check_model_config  # the model's signature is its schema (imports torch)

    for key, problem in check_model_config(c.get("model") or {}):
        raise ConfigError(f"config key '{key}': {problem}")
    t, p = c["trainer"], c["parallel"]
    _require(isinstance(c.get("seed"), int) and not isinstance(c.get("seed"), bool) and c["seed"] >= 0, "seed",
             f"must be a non-negative integer, got {c.get('seed')!r}")
    _require(
        t["batch_size"] >= world_size,
        "trainer.batch_size",
        f"global batch {t['batch_size']} is smaller than the world size {world_size}: some ranks would get no windows",
    )
    if p["even_batches"]:
        _require(
            t["batch_size"] % world_size == 0,
            "trainer.batch_size",
            f"global batch {t['batch_size']} is not divisible by the world size {world_size} "
            "(parallel.even_batches=true); pick a multiple or set parallel.even_batches=false",
        )
    from worldpipe.parallel.layout import validate_layout  # the layout's own rules (degrees, model axes)

    validate_layout(c, world_size)


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
    canonical = json.dumps(identity_config(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Readable lines `key: old -> new` for flattened configs (missing keys shown as <absent>)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, "<absent>"), new.get(key, "<absent>")
        if before != after:
            lines.append(f"  {key}: {before!r} -> {after!r}")
    return lines

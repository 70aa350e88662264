"""Validation, hashing and diffing of the resolved training config.

Validation runs before any work starts (no process group, no data read), and every error names the key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

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
    "run_dir",
)

STRATEGIES = ("none", "ddp", "fsdp2")


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
    """Check the training config for the given world size; raise ConfigError naming the bad key."""
    c = to_container(cfg)
    t, d, p, k = c["trainer"], c["data"], c["parallel"], c["checkpoint"]
    for key in ("steps", "batch_size", "log_every"):
        _require(isinstance(t[key], int) and t[key] > 0, f"trainer.{key}", f"must be a positive integer, got {t[key]!r}")
    _require(isinstance(t["lr"], int | float) and t["lr"] > 0, "trainer.lr", f"must be positive, got {t['lr']!r}")
    _require(t["warmup_steps"] >= 0, "trainer.warmup_steps", f"must be >= 0, got {t['warmup_steps']!r}")
    _require(0 <= t["min_lr_ratio"] <= 1, "trainer.min_lr_ratio", f"must be in [0, 1], got {t['min_lr_ratio']!r}")
    _require(t["grad_clip"] > 0, "trainer.grad_clip", f"must be positive, got {t['grad_clip']!r}")
    _require(t["threads_per_rank"] >= 1, "trainer.threads_per_rank", "must be >= 1")
    for key in ("window", "stride"):
        _require(isinstance(d[key], int) and d[key] > 0, f"data.{key}", f"must be a positive integer, got {d[key]!r}")
    _require(d["window"] >= 2, "data.window", "must be >= 2 (the model predicts the next step)")
    _require(p["strategy"] in STRATEGIES, "parallel.strategy", f"must be one of {STRATEGIES}, got {p['strategy']!r}")
    _require(p["nproc_per_node"] >= 1, "parallel.nproc_per_node", "must be >= 1")
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
    _require(k["every"] > 0, "checkpoint.every", f"must be a positive integer, got {k['every']!r}")
    _require(k["keep_last"] >= 2, "checkpoint.keep_last", f"must be >= 2, got {k['keep_last']!r}")
    _require(k["keep_every"] is None or k["keep_every"] > 0, "checkpoint.keep_every", "must be null or positive")
    _require(k["verify"] in ("size", "sha256", "first"), "checkpoint.verify", "must be size, sha256 or first")
    from worldpipe.parallel.layout import validate_layout  # the layout's own rules (degrees, model axes)

    validate_layout(c, world_size)


def _is_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in RESUME_SAFE_KEYS)


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

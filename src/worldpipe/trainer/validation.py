"""The training config a trainer accepts: group schemas, the model's own signature, the layout's rules.

Runs before any work starts (no process group, no data read): the launcher's preflight calls it before any
process starts, and every rank again on its own config. Every error names the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from omegaconf import DictConfig

from worldpipe.config import validation_cache
from worldpipe.config.identity import ConfigError, to_container
from worldpipe.config.schema import check_ranges
from worldpipe.config.tracking_uri import tracking_uri_problem
from worldpipe.measure.startup import mark


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"config key '{key}': {message}")


def validate_config(cfg: DictConfig | Mapping, world_size: int, remember_pass: bool = False) -> None:
    """Check the training config for the given world size; raise ConfigError naming the bad key.

    Types and single-key ranges come from the group schemas (:mod:`worldpipe.config.schema`); the checks that
    relate several keys (or the world size) are here, once. ``remember_pass``: skip the checks that import torch
    (the model's signature, the layout's rules) for a config that passed them with this code before, and record
    a pass (:mod:`worldpipe.config.validation_cache`; the Snakefile's parse, which needs no torch otherwise).
    """
    mark("config_validated")  # once per start (`worldpipe bench startup`, tests/trainer/test_local_run.py)
    c = to_container(cfg)
    for key, problem in check_ranges(c):
        raise ConfigError(f"config key '{key}': {problem}")
    key = validation_cache.verdict_key(c, world_size) if remember_pass else None
    torch_checks = not validation_cache.passed_before(key)
    if torch_checks:
        _check_model(c)
    t, p = c["trainer"], c["parallel"]
    tracking, env_uri = c.get("tracking") or {}, os.environ.get("MLFLOW_TRACKING_URI")
    if tracking.get("enabled") and not tracking.get("uri") and env_uri:
        problem = tracking_uri_problem(env_uri)
        _require(problem is None, "tracking.uri", f"unset, so $MLFLOW_TRACKING_URI is used, and {problem}")
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
    if torch_checks:
        _check_layout(c, world_size)
        validation_cache.record_pass(key)


def _check_model(c: Mapping) -> None:
    """The model's constructor signature is its schema. Imported here: models bring torch (seconds)."""
    from worldpipe.models import check_model_config

    for key, problem in check_model_config(c.get("model") or {}):
        raise ConfigError(f"config key '{key}': {problem}")


def _check_layout(c: Mapping, world_size: int) -> None:
    """The layout's own rules (degrees, model axes); imported here for the same reason (torch start-up)."""
    from worldpipe.parallel.validation import validate_layout

    validate_layout(c, world_size)


def check_observation(cfg: DictConfig | Mapping, spec: Mapping, dataset: str) -> None:
    """The array the model observes is stored by the dataset, at the size the model draws (frame models).

    ``spec``: the dataset spec from its manifest. Raises ConfigError naming the model key.
    """
    from worldpipe.models import observation_key  # torch, as for the model's signature above

    model = to_container(cfg).get("model") or {}
    if not model.get("_target_") or observation_key(model) != "pixels":
        return
    _require(bool(spec.get("pixels")), "model._target_",
             f"{model['_target_']} learns from frames, but {dataset} stores none (set pixels: true in its spec)")
    size = model.get("image_size")
    _require(size is None or size == spec.get("pixel_size"), "model.image_size",
             f"{size}, but {dataset} stores {spec.get('pixel_size')}x{spec.get('pixel_size')} frames (pixel_size)")


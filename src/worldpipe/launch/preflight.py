"""Preflight: everything about a training run that can be checked before any process starts.

Composing the config (unknown groups or keys), every override's value against the type of the value it
replaces, the config's own rules (:func:`worldpipe.trainer.validation.validate_config`), and the data: the store and the
manifest exist and describe the same dataset. Light imports only (no torch): the Snakefile's plan
(:func:`worldpipe.pipeline.plan.plan`) runs :func:`checked_config` while it is parsed, so a bad value fails before the
data stages run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from omegaconf import DictConfig

from worldpipe.config.compose import check_override_syntax, check_value_types, compose_config
from worldpipe.config.identity import ConfigError, to_container
from worldpipe.config.paths import CONF_DIR
from worldpipe.core.errors import UserError
from worldpipe.core.locations import local_path
from worldpipe.trainer.validation import check_observation, validate_config


class DataMismatch(UserError):
    """The data store or manifest is missing, unreadable, or they describe different datasets."""


def world_size_of(cfg: DictConfig | Mapping) -> int:
    """Ranks the config asks for (its parallel section is type-checked first)."""
    p = to_container(cfg)["parallel"]
    for key in ("nproc_per_node", "nnodes"):
        if not isinstance(p[key], int) or isinstance(p[key], bool) or p[key] < 1:
            raise ConfigError(f"config key 'parallel.{key}': must be a positive integer, got {p[key]!r}")
    return p["nproc_per_node"] * p["nnodes"]


def checked_config(overrides: Sequence[str], config_dir: Path = CONF_DIR, remember_pass: bool = False) -> DictConfig:
    """Compose and fully validate the training config for ``overrides`` (no data is read).

    ``remember_pass``: see :func:`worldpipe.trainer.validation.validate_config` (the Snakefile's parse only).
    """
    check_override_syntax(overrides)
    cfg = compose_config(overrides, config_dir)
    validate(cfg, overrides, config_dir, remember_pass)
    return cfg


def validate(cfg: DictConfig, overrides: Sequence[str], config_dir: Path = CONF_DIR,
             remember_pass: bool = False) -> None:
    """Fully validate ``cfg``, composed from ``overrides``: each override's value type, then the config's rules."""
    check_value_types(cfg, overrides, config_dir)
    validate_config(cfg, world_size_of(cfg), remember_pass)


def check_window(cfg: DictConfig | Mapping, max_steps: object, dataset: str) -> None:
    """A training window must fit in the dataset's episodes (``max_steps``, from its manifest or spec).

    A longer window is all padding past the episode's end: it trains on nothing new and costs its full length
    in every step (a 100000-step window on 64-step episodes runs for hours without a single log line).
    """
    window = to_container(cfg)["data"]["window"]
    if isinstance(max_steps, int) and isinstance(window, int) and window > max_steps:
        raise ConfigError(f"config key 'data.window': {window} steps is longer than the episodes of {dataset}, "
                          f"which have at most {max_steps} steps; use data.window <= {max_steps}")


def check_data(cfg: DictConfig) -> str:
    """The store and manifest exist and belong together, and the window fits the episodes; returns the dataset hash.

    Raises DataMismatch (or ConfigError for ``data.window``).

    "Belong together": the manifest was sealed from this store, checked cheaply by the store's root metadata
    (its dataset spec, hashed into the manifest) rather than by reading any shard.
    """
    # Imported on use: data.manifest brings zarr and fsspec (start-up time at every Snakefile parse).
    from worldpipe.data.manifest import ManifestError, load_manifest

    store, manifest_path = str(cfg.data.store), str(cfg.data.manifest)
    local_store, local_manifest = (None if (p := local_path(u)) is None else Path(p) for u in (store, manifest_path))
    if local_manifest is not None and not local_manifest.is_file():
        raise DataMismatch(f"config key 'data.manifest': no dataset manifest at {manifest_path}")
    if local_store is not None and not (local_store / "zarr.json").is_file():
        raise DataMismatch(f"config key 'data.store': no trajectory store at {store} (no zarr.json)")
    try:
        manifest = load_manifest(manifest_path)
    except (ManifestError, OSError) as exc:
        raise DataMismatch(f"config key 'data.manifest': {exc}") from exc
    spec = manifest.get("spec") or {}
    described = f"dataset {spec.get('name')!r} (data.manifest {manifest_path})"
    check_window(cfg, spec.get("max_steps"), described)
    check_observation(cfg, spec, described)
    if local_store is None:
        return manifest["dataset_hash"]
    try:
        meta = json.loads((local_store / "zarr.json").read_bytes())
        stored_spec = meta["attributes"]["worldpipe"]["spec"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataMismatch(f"config key 'data.store': {store} is not a worldpipe trajectory store ({exc})") from exc
    if stored_spec != manifest.get("spec"):
        differs = sorted(k for k in set(stored_spec) | set(manifest.get("spec") or {})
                         if stored_spec.get(k) != (manifest.get("spec") or {}).get(k))
        raise DataMismatch(
            f"data.manifest {manifest_path} (dataset {manifest.get('spec', {}).get('name')!r}, hash "
            f"{manifest['dataset_hash'][:16]}…) belongs to another dataset than data.store {store} (dataset "
            f"{stored_spec.get('name')!r}; spec differs in {', '.join(differs)}); point both at the same dataset")
    return manifest["dataset_hash"]

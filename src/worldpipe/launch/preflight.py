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

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from worldpipe.config.identity import ConfigError, flatten, to_container
from worldpipe.config.paths import CONF_DIR
from worldpipe.core.errors import UsageError, UserError
from worldpipe.trainer.validation import validate_config


class DataMismatch(UserError):
    """The data store or manifest is missing, unreadable, or they describe different datasets."""


def compose_config(overrides: Sequence[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """The resolved training config for these Hydra overrides (raises on unknown groups or keys).

    ``config_dir`` holds the primary ``config.yaml``: conf/ for a new run, a recorded config for a rerun.
    """
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def check_override_syntax(overrides: Sequence[str]) -> None:
    """Every override is ``key=value`` (or ``~key`` to delete a key); raises UsageError naming the bad one."""
    for override in overrides:
        key = _override_key(override)
        if override.startswith("~") and "=" not in override:
            continue
        if "=" not in override or not key or any(c.isspace() for c in key):
            raise UsageError(f"override {override!r} is not key=value")


def group_selections(overrides: Sequence[str]) -> list[str]:
    """The overrides that choose a config group (``experiment=smoke``), not a value."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    return [o for o in overrides if "=" in o and _override_key(o) in groups]


def _type_problem(reference: object, value: object) -> str | None:
    if reference is None or value is None or isinstance(reference, str):
        return None
    if isinstance(reference, bool):
        return None if isinstance(value, bool) else "a boolean"
    if isinstance(reference, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(reference, float):
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "a number"
    if isinstance(reference, list | dict):
        return None if isinstance(value, type(reference)) else f"a {type(reference).__name__}"
    return None


def check_value_types(cfg: DictConfig | Mapping, overrides: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """Each value override must have the type of the value it replaces; raises ConfigError naming the key.

    The reference is composed from the same ``config_dir`` as ``cfg`` (its groups may exist only there)."""
    values = [o for o in overrides if "=" in o and o not in group_selections(overrides)]
    if not values:
        return
    reference = flatten(to_container(compose_config(group_selections(overrides), config_dir)))
    composed = flatten(to_container(cfg))
    for override in values:
        key = _override_key(override)
        if key.startswith("hydra.") or key not in reference or key not in composed:
            continue
        expected = _type_problem(reference[key], composed[key])
        if expected is not None:
            raise ConfigError(f"config key '{key}': must be {expected}, got {composed[key]!r} "
                              f"(from override {override!r})")


def world_size_of(cfg: DictConfig | Mapping) -> int:
    """Ranks the config asks for (its parallel section is type-checked first)."""
    p = to_container(cfg)["parallel"]
    for key in ("nproc_per_node", "nnodes"):
        if not isinstance(p[key], int) or isinstance(p[key], bool) or p[key] < 1:
            raise ConfigError(f"config key 'parallel.{key}': must be a positive integer, got {p[key]!r}")
    return p["nproc_per_node"] * p["nnodes"]


def checked_config(overrides: Sequence[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """Compose and fully validate the training config for ``overrides`` (no data is read)."""
    check_override_syntax(overrides)
    cfg = compose_config(overrides, config_dir)
    check_value_types(cfg, overrides, config_dir)
    validate_config(cfg, world_size_of(cfg))
    return cfg


def _local(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(url.removeprefix("file://"))
    return None if "://" in url else Path(url)


def check_data(cfg: DictConfig) -> str:
    """The store and manifest exist and belong together; returns the dataset hash. Raises DataMismatch.

    "Belong together": the manifest was sealed from this store, checked cheaply by the store's root metadata
    (its dataset spec, hashed into the manifest) rather than by reading any shard.
    """
    from worldpipe.data.manifest import ManifestError, load_manifest

    store, manifest_path = str(cfg.data.store), str(cfg.data.manifest)
    local_store, local_manifest = _local(store), _local(manifest_path)
    if local_manifest is not None and not local_manifest.is_file():
        raise DataMismatch(f"config key 'data.manifest': no dataset manifest at {manifest_path}")
    if local_store is not None and not (local_store / "zarr.json").is_file():
        raise DataMismatch(f"config key 'data.store': no trajectory store at {store} (no zarr.json)")
    try:
        manifest = load_manifest(manifest_path)
    except (ManifestError, OSError) as exc:
        raise DataMismatch(f"config key 'data.manifest': {exc}") from exc
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

"""Composing the training config from `conf/` and Hydra overrides, and checking each override's value type.

Light (no torch): the Snakefile composes while it is parsed, and the launcher before any process starts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from worldpipe.config.identity import ConfigError, flatten, to_container
from worldpipe.config.paths import CONF_DIR
from worldpipe.config.schema import register_schemas
from worldpipe.core.errors import UsageError


def compose_config(overrides: Sequence[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """The resolved training config for these Hydra overrides (raises on unknown groups or keys).

    ``config_dir`` holds the primary ``config.yaml``: conf/ for a new run, a recorded config for a rerun.
    """
    register_schemas()  # the groups' structured schemas (`tracking/schema`, ...) that conf/ extends
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


def value_override(key: str, value: str) -> str:
    """``key=value`` that Hydra reads back as exactly ``value`` (single-quoted, escaped, when it must be)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = f"{key}={value}"
    try:
        if OverridesParser.create().parse_override(plain).value() == value:
            return plain
    except Exception:  # noqa: BLE001 - any grammar error: the value needs quoting
        pass
    return f"{key}='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


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


@functools.lru_cache(maxsize=8)
def _reference(groups: tuple[str, ...], config_dir: Path) -> dict:
    # The same group choices compose the same reference: a sweep's points share one (read, never changed).
    return flatten(to_container(compose_config(groups, config_dir)))


def check_value_types(cfg: DictConfig | Mapping, overrides: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """Each value override must have the type of the value it replaces; raises ConfigError naming the key.

    The reference is composed from the same ``config_dir`` as ``cfg`` (its groups may exist only there)."""
    values = [o for o in overrides if "=" in o and o not in group_selections(overrides)]
    if not values:
        return
    reference = _reference(tuple(group_selections(overrides)), Path(config_dir))
    composed = flatten(to_container(cfg))
    for override in values:
        key = _override_key(override)
        if key.startswith("hydra.") or key not in reference or key not in composed:
            continue
        expected = _type_problem(reference[key], composed[key])
        if expected is not None:
            raise ConfigError(f"config key '{key}': must be {expected}, got {composed[key]!r} "
                              f"(from override {override!r})")

"""Composing the training config from `conf/` and Hydra overrides, and checking each override's value type.

Light (no torch): the Snakefile composes while it is parsed, and the launcher before any process starts.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

from worldpipe.config.identity import ConfigError, flatten, to_container
from worldpipe.config.paths import CONF_DIR
from worldpipe.config.schema import GROUP_SCHEMAS, SCHEMA_NAME, register_schemas
from worldpipe.core.errors import UsageError
from worldpipe.measure.startup import mark


def compose_config(overrides: Sequence[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """The resolved training config for these Hydra overrides (raises on unknown groups or keys).

    ``config_dir`` holds the primary ``config.yaml``: conf/ for a new run, a recorded config for a rerun. Hydra's
    refusals become one ConfigError line naming the key or group, why, and what would work; a key that ``+`` adds
    to a schema-typed group is refused too (Hydra would accept it, and nothing would read it).

    Each call is one ``config_composed`` event of the start-up trace (:mod:`worldpipe.measure.startup`): a
    `worldpipe train` composes its config once (tests/launch/test_compose_once.py counts them).
    """
    mark("config_composed")
    return _compose(overrides, config_dir)


def _compose(overrides: Sequence[str], config_dir: Path) -> DictConfig:
    register_schemas()  # the groups' structured schemas (`tracking/schema`, ...) that conf/ extends
    _refuse_schema_options(overrides, config_dir)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides))
    except MissingConfigException as err:
        raise ConfigError(_missing_option(err)) from None
    except ConfigCompositionException as err:
        raise ConfigError(_composition_problem(err)) from None
    _refuse_unknown_keys(cfg)
    return cfg


def with_values(cfg: DictConfig, overrides: Sequence[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """A copy of the composed ``cfg`` with plain value overrides (``key=value``, ``+key=value``) applied as Hydra
    applies them after composing (its override grammar parses each value; ``OmegaConf.update`` sets it).

    For configs that differ from one composed already only in values (a loop's rounds: ``data.name``, ``seed``,
    ``+init_from``): a composition costs ~0.5 s, a copy milliseconds. An override that chooses a config group, or
    deletes, sweeps or repackages, needs a composition: ValueError. ``+key`` on a key ``cfg`` has already sets it.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    updated = copy.deepcopy(cfg)
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if (override.is_delete() or override.is_sweep_override() or override.package is not None
                or (Path(config_dir) / key.replace(".", "/")).is_dir()):
            raise ValueError(f"override {override.input_line!r} is not a plain value: compose the config instead")
        if not override.is_add() and OmegaConf.select(updated, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(_unknown_key(key))
        with open_dict(updated):
            OmegaConf.update(updated, key, override.value(), merge=True)
    return updated


_ABSENT = object()


def _missing_option(err: MissingConfigException) -> str:
    group, _, option = str(err.missing_cfg_file or "").rpartition("/")
    if not group or err.options is None:
        return " ".join(str(err).split("Config search path")[0].split())
    return _no_option(group, option, [o for o in err.options if o != SCHEMA_NAME])


def _no_option(group: str, option: str, options: Sequence[str]) -> str:
    return f"config group '{group}': no option '{option}'; available: {', '.join(sorted(options))}"


def _refuse_schema_options(overrides: Sequence[str], config_dir: Path) -> None:
    """A group's schema is what its options extend, not an option: ``numerics=schema`` is refused as an unknown
    option (Hydra would compose the bare schema)."""
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~").split("@", 1)[0]
        if sep and group in GROUP_SCHEMAS and value.strip().strip("'\"") == SCHEMA_NAME:
            options = [p.stem for p in (Path(config_dir) / group).glob("*.yaml") if p.stem != SCHEMA_NAME]
            raise ConfigError(_no_option(group, SCHEMA_NAME, options))


def _unknown_key(key: str) -> str:
    group, _, name = key.partition(".")
    known = [f.name for f in fields(GROUP_SCHEMAS[group])] if group in GROUP_SCHEMAS else []
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {group}.{close[0]}?" if close else (f"; its keys: {', '.join(known)}" if known else "")
    return f"config key '{key}': not a key of the {group} group{hint}"


def _composition_problem(err: ConfigCompositionException) -> str:
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, ConfigAttributeError) and key:
        return _unknown_key(str(key))
    if isinstance(cause, OmegaConfBaseException) and key:
        reason = str(getattr(cause, "msg", "") or cause).splitlines()[0]
        value = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", reason)
        if value:
            return f"config key '{key}': must be {_ARTICLE.get(value.group(2), value.group(2))}, got {value.group(1)!r}"
        value = re.match(r"Value '(.*)' is not a valid bool", reason)
        if value:
            return f"config key '{key}': must be true or false, got {value.group(1)!r}"
        return f"config key '{key}': {reason}"
    return " ".join(str(err).split())


_ARTICLE = {"Integer": "an integer", "Float": "a number", "String": "a string"}


def _refuse_unknown_keys(cfg: DictConfig) -> None:
    for group, schema in GROUP_SCHEMAS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        known = {f.name for f in fields(schema)}
        extra = sorted(set(node.keys()) - known)
        if extra:
            raise ConfigError(_unknown_key(f"{group}.{extra[0]}"))


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
    # The same group choices compose the same reference: a sweep's points share one (read, never changed). It is
    # the groups' defaults, part of the type check, not the run's config: no `config_composed` event.
    return flatten(to_container(_compose(groups, config_dir)))


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

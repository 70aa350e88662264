"""A planner's config: ``conf/planner/<name>.yaml`` with ``key=value`` overrides, checked against the planner class.

Read by the closed-loop evaluation and by the pipeline's plan of collection rounds (whose dataset specs carry the
whole planner config, so its hash covers every setting the collecting planner ran with).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from worldpipe.core.errors import UsageError


class PlannerConfigError(UsageError):
    """A planner that cannot be read, or an override it does not take (one line naming it)."""


def planner_config(name: str, overrides: list[str], config_dir: Path) -> dict[str, Any]:
    """``conf/planner/<name>.yaml`` with ``key=value`` overrides: a plain dict with its ``_target_``.

    A missing planner, an unknown key or a value of the wrong type is one line naming it (PlannerConfigError).
    """
    from hydra.utils import get_class  # start-up: Hydra loads only where a planner config is read
    from omegaconf import OmegaConf

    path = Path(config_dir) / "planner" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise PlannerConfigError(f"no planner {name!r} in {path.parent} (have: {', '.join(known)})")
    config = OmegaConf.to_container(OmegaConf.load(path))
    planner_class = get_class(config["_target_"])
    fields = {f.name: f.type for f in dataclasses.fields(planner_class)}
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or key not in fields:
            raise PlannerConfigError(f"planner override {override!r}: {name} has no key {key!r} "
                                     f"(keys: {', '.join(sorted(fields))})")
        value = yaml.safe_load(text)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (fields[key] == "int" and not isinstance(value, int)):
            raise PlannerConfigError(f"planner override {override!r}: {key} must be {fields[key]}, got {text!r}")
        config[key] = float(value) if fields[key] == "float" else value
    for key, limits in getattr(planner_class, "LIMITS", {}).items():
        problem = _out_of_range(config.get(key), *limits)
        if problem:
            given = next((o for o in reversed(overrides) if o.partition("=")[0] == key), None)  # the last wins
            where = f"planner override {given!r}" if given else f"{path}: {key}"
            raise PlannerConfigError(f"{where}: {key} must be {problem}, got {config.get(key)!r}")
    return config


def _out_of_range(value: Any, low: Any, low_inclusive: bool, high: Any, high_inclusive: bool) -> str | None:
    """The range ``value`` misses, as text (``>= 1``, ``in (0, 1]``); None when it is inside (or not set)."""
    if value is None:
        return None
    above = low is None or (value >= low if low_inclusive else value > low)
    below = high is None or (value <= high if high_inclusive else value < high)
    if above and below:
        return None
    if high is None:
        return f"{'>=' if low_inclusive else '>'} {low}"
    return f"in {'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"

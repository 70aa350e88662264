"""Sweeps: a grid (or an explicit list) of Hydra overrides, optionally crossed with seeds, as named points.

A pipeline config declares::

    sweep:
      name: lr_stoch            # names the results directory and the MLflow parent run
      experiment: smoke         # the Hydra experiment overlay every point starts from
      grid: {trainer.lr: [1.0e-3, 3.0e-3], model.stoch: [4, 8]}   # or points: [{trainer.lr: 1.0e-3}, ...]
      seeds: [0, 1]             # optional: every point once per seed (the root `seed` key)

Each point is named by its values (``trainer.lr-0.001__model.stoch-4__seed-0``), so adding a value to the grid
never renames or reruns the points that already exist. Snakemake trains and evaluates each point in its own run
directory (``results/sweeps/<name>/<point>/``) and MLflow run, nested under the sweep's parent run.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldpipe.config import paths
from worldpipe.core.errors import UsageError

SEED_KEY = "seed"
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PLAIN = re.compile(r"^[A-Za-z0-9_.+-]+$")
# Keys a point must not set: where the run lives and records are decided by the sweep itself.
RESERVED_KEYS = ("run_dir", "experiment", "experiment_name", "checkpoint.dir", "tracking.experiment")


class SweepError(UsageError, ValueError):
    """A sweep declaration that cannot be expanded; the message names the key."""


@dataclass(frozen=True)
class SweepPoint:
    """One training run of a sweep: its values by Hydra key (the seed included when seeds are swept)."""

    values: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        """Directory-safe, stable name built from the values (no ',' or '=': Hydra reads those in overrides)."""
        return "__".join(f"{key}-{format_value(value)}" for key, value in self.values)

    @property
    def overrides(self) -> list[str]:
        """Hydra overrides that turn the sweep's base experiment into this point."""
        return [f"{key}={format_value(value)}" for key, value in self.values]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def run_name(self, sweep_name: str) -> str:
        """Short MLflow run name: the sweep's name, then the last part of each swept key with its value."""
        return sweep_name + "-" + "_".join(f"{key.rsplit('.', 1)[-1]}{format_value(v)}" for key, v in self.values)


def sweep_dir(sweep: Mapping[str, Any], root: Path | None = None) -> str:
    """Directory of a sweep (one run directory per point below it); ``root``: the conf/ tree to read paths from."""
    return paths.sweep_dir(str(sweep.get("name", "none")), root)


def sweep_targets(sweep: Mapping[str, Any] | None, root: Path | None = None) -> list[str]:
    """What the pipeline's `all` asks of a sweep: its comparison, which needs every point evaluated."""
    return [f"{sweep_dir(sweep, root)}/compare.txt", f"{sweep_dir(sweep, root)}/compare.png"] if sweep else []


def format_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back (and as a path component)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if not _PLAIN.match(text):
        raise SweepError(f"sweep value {text!r}: only letters, digits and _.+- are allowed in swept strings")
    return text


def _check_keys(keys: list[str], where: str) -> None:
    for key in keys:
        if not _KEY.match(key):
            raise SweepError(f"config key '{where}.{key}': not a dotted Hydra key")
        if key in RESERVED_KEYS:
            raise SweepError(f"config key '{where}.{key}': set by the sweep itself, cannot be swept")


def _grid_points(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    _check_keys(list(grid), "sweep.grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"config key 'sweep.grid.{key}': must be a non-empty list of values")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def _listed_points(points: list[Any]) -> list[dict[str, Any]]:
    if not isinstance(points, list) or not points:
        raise SweepError("config key 'sweep.points': must be a non-empty list of {key: value} mappings")
    out = []
    for index, point in enumerate(points):
        if not isinstance(point, Mapping) or not point:
            raise SweepError(f"config key 'sweep.points[{index}]': must be a non-empty {{key: value}} mapping")
        _check_keys(list(point), f"sweep.points[{index}]")
        out.append(dict(point))
    return out


def expand_sweep(sweep: Mapping[str, Any]) -> list[SweepPoint]:
    """Every point of a sweep declaration, in declaration order (grid order, then seeds)."""
    if ("grid" in sweep) == ("points" in sweep):
        raise SweepError("config key 'sweep': give exactly one of 'grid' or 'points'")
    base = _grid_points(sweep["grid"]) if "grid" in sweep else _listed_points(sweep["points"])
    seeds = sweep.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
            raise SweepError("config key 'sweep.seeds': must be a non-empty list of non-negative integers")
        if any(SEED_KEY in point for point in base):
            raise SweepError("config key 'sweep.seeds': the points already set 'seed'; sweep it in one place")
        base = [{**point, SEED_KEY: seed} for point in base for seed in seeds]
    points = [SweepPoint(tuple(point.items())) for point in base]
    names = [p.name for p in points]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SweepError(f"config key 'sweep': the same point appears more than once: {duplicates[0]}")
    return points


def swept_keys(sweep: Mapping[str, Any]) -> list[str]:
    """The keys that vary across the sweep's points, in declaration order (the seed last)."""
    keys: list[str] = []
    for point in expand_sweep(sweep):
        keys += [k for k, _ in point.values if k not in keys]
    varying = [k for k in keys if len({json.dumps(p.as_dict().get(k)) for p in expand_sweep(sweep)}) > 1]
    return [k for k in varying if k != SEED_KEY] + ([SEED_KEY] if SEED_KEY in varying else [])

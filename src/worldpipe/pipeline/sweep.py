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

import difflib
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from worldpipe.config import paths
from worldpipe.config.compose import compose_config
from worldpipe.config.identity import flatten, to_container
from worldpipe.core.errors import UsageError
from worldpipe.launch.preflight import checked_config
from worldpipe.pipeline.plan import identity_overrides, training_settings

SEED_KEY = "seed"
LABEL_KEY = "tracking.run_name"  # names the MLflow run; resume-safe, so the label is not part of a run's identity
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PLAIN = re.compile(r"^[A-Za-z0-9_.+-]+$")
# A sweep's name is one directory below results/sweeps/: no separators, and not '.', '..' or hidden.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
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
        """The point's ``experiment_name`` (part of its run identity): the sweep's name, then the last part of each
        swept key with its value."""
        return sweep_name + "-" + "_".join(f"{key.rsplit('.', 1)[-1]}{format_value(v)}" for key, v in self.values)

    @property
    def label(self) -> str:
        """The point's MLflow run name, its swept values in short form: ``lr=3e-4,stoch=8`` (a key by its last
        part unless two swept keys share it)."""
        lasts = [key.rsplit(".", 1)[-1] for key, _ in self.values]
        return ",".join(f"{last if lasts.count(last) == 1 else key}={short_value(value)}"
                        for (key, value), last in zip(self.values, lasts, strict=True))

    @property
    def label_override(self) -> str:
        """The Hydra override that names the point's MLflow run (quoted: the label holds ',' and '=')."""
        return f"{LABEL_KEY}='{self.label}'"


def sweep_dir(sweep: Mapping[str, Any], root: Path | None = None) -> str:
    """Directory of a sweep (one run directory per point below it); ``root``: the conf/ tree to read paths from."""
    return paths.sweep_dir(str(sweep.get("name", "none")), root)


def sweep_targets(sweep: Mapping[str, Any] | None, root: Path | None = None) -> list[str]:
    """What the pipeline's `all` asks of a sweep: its comparison, which needs every point evaluated."""
    return [f"{sweep_dir(sweep, root)}/compare.txt", f"{sweep_dir(sweep, root)}/compare.png"] if sweep else []


def short_value(value: Any) -> str:
    """A swept value as a person writes it: floats in the shorter of plain and exponent form (``3e-4``, ``0.5``)."""
    if isinstance(value, float) and not isinstance(value, bool) and value and math.isfinite(value):
        mantissa, exponent = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        compact = f"{mantissa}e{int(exponent)}"
        # exponent form only where plain digits get long (1e-3, not 1e2 for 100.0)
        return compact if abs(int(exponent)) >= 3 and len(compact) < len(repr(value)) else repr(value)
    return format_value(value)


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


def _check_name(sweep: Mapping[str, Any]) -> None:
    for key in ("name", "experiment"):
        value = sweep.get(key)
        if not isinstance(value, str) or not _NAME.match(value):
            raise SweepError(f"config key 'sweep.{key}': {value!r} is not a safe directory name (letters, digits "
                             "and _.- only, not starting with '.')")


def _grid_points(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(grid, Mapping) or not grid:
        raise SweepError("config key 'sweep.grid': must map at least one key to a list of values")
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
    if not isinstance(sweep, Mapping):
        raise SweepError(f"config key 'sweep': must be a mapping, got {sweep!r}")
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


def load_pipeline_config(path: Path) -> dict[str, Any]:
    """A pipeline config file as a mapping; SweepError (one line, naming the line and column) when it is not."""

    try:
        config = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SweepError(f"cannot read it: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SweepError(f"not valid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(config, dict):
        raise SweepError(f"must be a mapping of pipeline settings, got {type(config).__name__}")
    return config


def check_sweep(config: Mapping[str, Any], conf: Path) -> list[SweepPoint]:
    """The points of a pipeline config's sweep, each checked as a single run would be; SweepError names the key.

    Before any job is planned: the name is one safe directory name, the experiment exists in ``conf``, every swept key exists in its composed config
    (or names a config group), and each point's composed config passes the checks of a single run
    (:func:`worldpipe.launch.preflight.checked_config`, with the pipeline's overrides and settings).
    """
    sweep = config.get("sweep")
    if not isinstance(sweep, Mapping):
        raise SweepError(f"config key 'sweep': must be a mapping, got {sweep!r}")
    _check_name(sweep)
    points = expand_sweep(sweep)
    experiment = sweep["experiment"]
    known = sorted(p.stem for p in (conf / "experiment").glob("*.yaml"))
    if experiment not in known:
        raise SweepError(f"config key 'sweep.experiment': no experiment {experiment!r} in {conf}/experiment "
                         f"(known: {', '.join(known)})")
    base, settings = _run_overrides(config, experiment)
    keys = set(flatten(to_container(compose_config([*base, *settings], conf))))
    groups = {p.name for p in conf.iterdir() if p.is_dir()}
    for key in dict.fromkeys(k for point in points for k, _ in point.values):
        if key not in keys and key not in groups and not any(k.startswith(key + ".") for k in keys):
            close = difflib.get_close_matches(key, sorted(keys), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SweepError(f"config key '{_where(sweep, key)}': {key} is not a key of experiment "
                             f"{experiment!r}'s config{hint}")
    for point in points:
        _check_point(point, [*base, *point.overrides, *settings], conf)
    return points


def _where(sweep: Mapping[str, Any], key: str) -> str:
    """Where a swept key is declared in the sweep section (for the error line)."""
    if "grid" in sweep:
        return f"sweep.grid.{key}"
    index = next((i for i, point in enumerate(sweep.get("points") or []) if key in point), 0)
    return f"sweep.points[{index}].{key}"


def _run_overrides(config: Mapping[str, Any], experiment: str) -> tuple[list[str], list[str]]:
    """A sweep point's identity overrides and resume-safe settings, as the pipeline hands them to training."""
    train = {"nproc_per_node": 1, "nnodes": 1, "overrides": [], **(config.get("train") or {})}
    full = {**config, "train": train}
    return identity_overrides(full, experiment), training_settings(full, "")


def _check_point(point: SweepPoint, overrides: list[str], conf: Path) -> None:
    try:
        checked_config(overrides, conf, remember_pass=True)  # at parse time, as the plan's runs
    except Exception as err:  # noqa: BLE001 - Hydra and OmegaConf raise many types; all are config errors
        message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise SweepError(f"sweep point {point.name} ({' '.join(point.overrides)}) fails the checks of a "
                         f"single run: {message}") from None

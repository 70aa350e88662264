"""Runs side by side: the params that differ, the evaluation metrics, a metric-vs-swept-key plot.

A reference is a run id, a JSON file naming one (``train_done.json``, a sweep's ``parent.json``), or a sweep's
parent run, which stands for all of its point runs.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldpipe.core.axes import legend_outside, readable_log_axis
from worldpipe.core.errors import UsageError
from worldpipe.core.figures import save_figure
from worldpipe.tracking.evaluation import CONTROL_PREFIX, METRIC_PREFIX, SUMMARY_METRICS, control_summary_keys
from worldpipe.tracking.groups import point_runs, swept_keys_of
from worldpipe.tracking.records import NUMERICS_TAG

SEED_PARAM = "seed"
DEFAULT_METRIC = f"{METRIC_PREFIX}one_step_ratio"
TRAINING_METRICS = ("loss/total",)
# Params that name or locate rather than configure: they differ between any two runs (a rerun regenerates its
# data elsewhere), so the table omits them; what the data holds is compared by the dataset-hash tag.
NAMING_PARAMS = ("run_dir", "checkpoint.dir", "experiment_name", "tracking.run_name", "data.store", "data.manifest")
LOG_AXIS_SPAN = 2.5  # x values spanning this factor or more are plotted on a log axis (a 1e-3, 3e-3 lr grid)
IDENTITY_TAGS = ("worldpipe.git_sha", "worldpipe.dataset_hash", "worldpipe.checkpoint.digest",
                 "worldpipe.eval.heldout_dataset_hash", "worldpipe.world_size")


class ComparisonError(UsageError, ValueError):
    """A reference that names no run, or nothing to compare."""


@dataclass
class Comparison:
    runs: list  # mlflow Run objects, in table order
    swept: list[str]  # keys that vary (from the sweep, else the differing params)


def run_ids_of(refs: Sequence[str]) -> list[str]:
    """The run ids the references name (a JSON file read for its run id); ComparisonError for a JSON file that
    is not there, before any tracking store is opened."""
    return [_run_id(ref) for ref in refs]


def _run_id(ref: str) -> str:
    if not ref.endswith(".json"):
        return ref
    if not Path(ref).is_file():
        raise ComparisonError(f"{ref}: no such file (a run's train_done.json or a sweep's parent.json)")
    record = json.loads(Path(ref).read_text())
    run_id = record.get("run_id") or record.get("mlflow_run_id")
    if not run_id:
        raise ComparisonError(f"{ref}: has no 'run_id' or 'mlflow_run_id'")
    return run_id


def resolve(client, refs: Sequence[str]) -> Comparison:
    """The runs the references stand for (sweep parents expanded) and the keys they differ in."""
    runs, swept = [], []
    for ref in refs:
        run_id = _run_id(ref)
        try:
            run = client.get_run(run_id)
        except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for an unknown id
            raise ComparisonError(f"no MLflow run {run_id!r} at {client.tracking_uri}") from err
        keys = swept_keys_of(run)
        if keys is None:
            runs.append(run)
            continue
        points = point_runs(client, run_id)
        if not points:
            raise ComparisonError(f"sweep run {run_id} has no point runs yet")
        runs += points
        swept += [k for k in keys if k not in swept]
    if not swept:
        swept = differing_params(runs)
    return Comparison(runs, swept)


def differing_params(runs: list) -> list[str]:
    """Params whose values are not all equal, naming params aside."""
    keys = sorted(set().union(*(r.data.params for r in runs)) - set(NAMING_PARAMS))
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else "—" if value is None else str(value)


def comparison_sections(comparison: Comparison) -> dict[str, list[tuple[str, list[Any]]]]:
    """{section title: [(key, one value per run)]}: differing params, open-loop evaluation, closed-loop control
    and training metrics, and the identity tags (numerics environment included) that differ."""
    runs = comparison.runs
    differing = differing_params(runs)
    ordered = [k for k in comparison.swept if k in differing] + [k for k in differing if k not in comparison.swept]
    eval_keys = [f"{METRIC_PREFIX}{k}" for k in SUMMARY_METRICS]
    eval_keys += _last_horizon_keys({k for r in runs for k in r.data.metrics if k.startswith(METRIC_PREFIX)}
                                    - set(eval_keys))
    numerics = sorted({k for r in runs for k in r.data.tags if k.startswith(NUMERICS_TAG + ".")})
    control_keys = control_summary_keys({k for r in runs for k in r.data.metrics if k.startswith(CONTROL_PREFIX)})
    return {
        "param differences": [(k, [r.data.params.get(k) for r in runs]) for k in ordered],
        "evaluation": [(k, [r.data.metrics.get(k) for r in runs]) for k in eval_keys],
        "control (closed loop)": [(k, [r.data.metrics.get(k) for r in runs]) for k in control_keys],
        "training (final)": [(k, [r.data.metrics.get(k) for r in runs]) for k in TRAINING_METRICS],
        "identity differences": [(k, [r.data.tags.get(k) for r in runs]) for k in (*IDENTITY_TAGS, *numerics)
                                 if len({r.data.tags.get(k) for r in runs}) > 1],
    }


def comparison_table(comparison: Comparison) -> str:
    """Plain-text table: one column per run, each as wide as its widest value (values are never cut)."""
    runs, sections = comparison.runs, comparison_sections(comparison)
    columns = [[r.info.run_id, r.info.run_name or ""] + [_cell(vals[i]) for rows in sections.values()
                                                          for _, vals in rows] for i, r in enumerate(runs)]
    widths = [max(12, *(len(text) for text in column)) for column in columns]
    key_w = max(len("identity differences"), *(len(k) for rows in sections.values() for k, _ in rows))

    def row(key: str, values: list[Any]) -> str:
        return f"{key:<{key_w}}  " + "  ".join(f"{_cell(v):>{w}}" for v, w in zip(values, widths, strict=True))

    out = [row("run", [r.info.run_id for r in runs]), row("name", [r.info.run_name or "" for r in runs]), ""]
    for title, rows in sections.items():
        out += [f"{title}: none", ""] if not rows else [title, "-" * key_w, *(row(k, v) for k, v in rows), ""]
    return "\n".join(out).rstrip() + "\n"


def comparison_json(comparison: Comparison) -> str:
    """The same comparison for programs: runs, and per section {key: one value per run} (values as recorded)."""
    return json.dumps({"runs": [{"run_id": r.info.run_id, "run_name": r.info.run_name} for r in comparison.runs],
                       "sections": {title: dict(rows) for title, rows in comparison_sections(comparison).items()}},
                      indent=1) + "\n"


def comparison_csv(comparison: Comparison) -> str:
    """The same comparison as CSV: ``section,key,<one column per run id>``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["section", "key", *(r.info.run_id for r in comparison.runs)])
    for title, rows in comparison_sections(comparison).items():
        for key, values in rows:
            writer.writerow([title, key, *("" if v is None else v for v in values)])
    return out.getvalue()


def _last_horizon_keys(keys: set[str]) -> list[str]:
    """Of per-horizon metrics (``eval/<name>/hNN``) only each name's last horizon; other keys as they are."""
    last: dict[str, tuple[int, str]] = {}
    for key in keys:
        name, _, horizon = key.rpartition("/h")
        group, number = (name, int(horizon)) if horizon.isdigit() else (key, 0)
        last[group] = max(last.get(group, (-1, "")), (number, key))
    return sorted(key for _, key in last.values())


def _number(text: str | None) -> float | str | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def plot_comparison(comparison: Comparison, path: str | Path, metric: str = DEFAULT_METRIC,
                    x_key: str | None = None) -> dict:
    """Metric against the first swept key, one line per combination of the other keys; seeds as error bars.

    Returns the plotted series: {label: [(x, mean, std, n), ...]}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in comparison.swept if k != SEED_PARAM]
    x_key = x_key or (keys[0] if keys else SEED_PARAM)
    others = [k for k in keys if k != x_key]
    groups: dict[str, dict[Any, list[float]]] = {}
    for run in comparison.runs:
        value = run.data.metrics.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        label = ", ".join(f"{k}={run.data.params.get(k)}" for k in others) or metric
        x = _number(run.data.params.get(x_key))
        groups.setdefault(label, {}).setdefault(x, []).append(value)
    if not groups:
        raise ComparisonError(f"none of the runs has the metric {metric!r}")
    series = {label: [(x, statistics.fmean(v), statistics.pstdev(v) if len(v) > 1 else 0.0, len(v))
                      for x, v in sorted(points.items(), key=lambda item: str(item[0]) if isinstance(item[0], str)
                                         else f"{item[0]:030.12f}")]
              for label, points in sorted(groups.items())}
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, means, stds, _ = zip(*points, strict=True)
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=4, label=label)
    ax.set_xlabel(x_key)
    ax.set_ylabel(metric)
    xs_all = [x for pts in series.values() for x, *_ in pts]
    if all(isinstance(x, float) and x > 0 for x in xs_all) and max(xs_all) >= LOG_AXIS_SPAN * min(xs_all):
        # A rate-like grid (1e-3, 3e-3, ...): log spacing, each swept value labelled as written.
        readable_log_axis(ax, "x", xs_all, ticks_at_values=True)
    elif all(isinstance(x, float) for x in xs_all):
        ax.set_xticks(sorted(set(xs_all)), [f"{x:g}" for x in sorted(set(xs_all))])
    seeds = max(n for pts in series.values() for *_, n in pts)
    ax.set_title(f"{metric} vs {x_key}" + (f" (mean ± std over {seeds} seeds)" if seeds > 1 else ""))
    legend_outside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=100, bbox_inches="tight")
    return series

"""Grouped MLflow runs: one parent run per sweep or collection loop, every point's or round's training run nested
under it.

The parent is found again by its tags (never created twice for one sweep name, or one loop, in one experiment); a
member's run is linked by tags only (``mlflow.parentRunId`` nests it in the UI), so linking is idempotent.

A sweep's parent says what the sweep is and how it came out: params ``sweep.points`` (the number of points) and one
per swept key (its values, as a JSON list); once every point is evaluated, :func:`summarize_sweep` gives it the
best point's metrics (same names as on the points, so the collapsed row in the run list shows them), the tags
``worldpipe.sweep.best_run`` / ``best_run_id`` / ``best_by`` and a description naming the winner, and an end
time that spans the points.

A loop's parent carries the loop's outcome with the round on the "Step" axis: ``rounds/return_mean`` (and its 95%
CI), ``rounds/score`` and ``rounds/heldout_ratio``, plus the scripted policy's and random's returns on the same
seeds; each value is logged once per round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from worldpipe.tracking.connection import ensure_experiment, tag_filter, unlogged
from worldpipe.tracking.delivery import CHANGED_TAG_PREFIX
from worldpipe.tracking.evaluation import PARENT_RUN_TAG, latest_metric, show_in_model_training_view

SWEEP_TAG = "worldpipe.sweep.name"
ROLE_TAG = "worldpipe.sweep.role"  # "parent" on the parent run, "point" on a point's training run
KEYS_TAG = "worldpipe.sweep.keys"  # parent: JSON list of the swept keys, in order
POINT_TAG = "worldpipe.sweep.point"
POINTS_PARAM = "sweep.points"
BEST_RUN_TAG, BEST_ID_TAG, BEST_BY_TAG = "worldpipe.sweep.best_run", "worldpipe.sweep.best_run_id", "worldpipe.sweep.best_by"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
VALUE_TAG_PREFIX = "worldpipe.sweep.value."  # point: one tag per swept key
PARENT, POINT = "parent", "point"
ROUNDS_TAG = "worldpipe.rounds.id"
ROUNDS_ROLE_TAG = "worldpipe.rounds.role"  # "parent" on the parent run, "round" on each round's training run
ROUND_TAG = "worldpipe.round"
ROUNDS_PREFIX = "rounds/"


def grouping_run(client, experiment: str, name: str, tags: Mapping[str, str]) -> str:
    """The id of the run that groups others (a sweep's or a loop's parent) in ``experiment``: found by its ``tags``
    or created with them, FINISHED (it groups, it does not run); the experiment shown as model training."""
    from mlflow.entities import RunStatus

    experiment_id = ensure_experiment(client, experiment)
    show_in_model_training_view(client, experiment_id)
    found = client.search_runs([experiment_id], max_results=1, filter_string=tag_filter(tags))
    if found:
        return found[0].info.run_id
    run_id = client.create_run(experiment_id, run_name=name, tags=dict(tags)).info.run_id
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    return run_id


def open_parent_run(client, experiment: str, sweep: str, keys: Sequence[str], points: int,
                    values: Mapping[str, Sequence[Any]] | None = None) -> str:
    """The parent run of sweep ``sweep`` in MLflow experiment ``experiment``, created on first use; params: the
    number of points and each swept key's ``values``."""
    from mlflow.entities import Param, RunTag

    run_id = grouping_run(client, experiment, sweep, {SWEEP_TAG: sweep, ROLE_TAG: PARENT})
    params = {POINTS_PARAM: str(points), **{key: json.dumps(list(v)) for key, v in (values or {}).items()}}
    # Params the run lacks; a changed value (a grid grown since) goes to tag ``worldpipe.changed.<key>``.
    held = client.get_run(run_id).data.params
    tags = [RunTag(KEYS_TAG, json.dumps(list(keys))), RunTag("worldpipe.sweep.points", str(points)),
            *(RunTag(f"{CHANGED_TAG_PREFIX}{k}", v) for k, v in params.items() if k in held and held[k] != v)]
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items() if k not in held], tags=tags)
    return run_id


def link_point(client, parent_run_id: str, run_id: str, sweep: str, point: str, values: Mapping[str, Any]) -> None:
    """Nest a point's training run under the sweep's parent run and tag its swept values."""
    from mlflow.entities import RunTag

    tags = {PARENT_RUN_TAG: parent_run_id, SWEEP_TAG: sweep, ROLE_TAG: POINT, POINT_TAG: point}
    tags.update({f"{VALUE_TAG_PREFIX}{key}": json.dumps(value) for key, value in values.items()})
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in sorted(tags.items())])


def point_runs(client, parent_run_id: str) -> list:
    """The training runs of a sweep (its nested point runs), in point-name order."""
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], max_results=10000,
                              filter_string=tag_filter({PARENT_RUN_TAG: parent_run_id, ROLE_TAG: POINT}))
    return sorted(runs, key=lambda r: r.data.tags.get(POINT_TAG, r.info.run_id))


def swept_keys_of(run) -> list[str] | None:
    """The swept keys recorded on a parent run (None: not a sweep parent)."""
    if run.data.tags.get(ROLE_TAG) != PARENT:
        return None
    return json.loads(run.data.tags.get(KEYS_TAG, "[]"))


def summarize_sweep(client, parent_run_id: str, metric: str, keys: Sequence[str] = ()):
    """Record on the parent run which point won by ``metric`` (lowest), with that point's metrics; the best run
    (None when no point has the metric yet: nothing is recorded)."""
    from mlflow.entities import Metric, RunStatus, RunTag

    points = point_runs(client, parent_run_id)
    scored = [run for run in points if metric in run.data.metrics]
    if not scored:
        return None
    best = min(scored, key=lambda run: run.data.metrics[metric])
    name = best.info.run_name or best.info.run_id
    # The metric that decides, the given keys, and the point's evaluation summaries (``eval/*`` without ``/``).
    summaries = sorted(k for k in best.data.metrics if k.startswith("eval/") and k.count("/") == 1)
    metrics = [Metric(m.key, m.value, m.timestamp, m.step) for key in dict.fromkeys([metric, *keys, *summaries])
               for m in [latest_metric(client, best.info.run_id, key)] if m is not None]
    note = (f"Best of {len(points)} points by lowest `{metric}`: **{name}** "
            f"({metric} = {best.data.metrics[metric]:.4g})")
    tags = [RunTag(BEST_RUN_TAG, name), RunTag(BEST_ID_TAG, best.info.run_id), RunTag(BEST_BY_TAG, metric),
            RunTag(NOTE_TAG, note)]
    client.log_batch(parent_run_id, metrics=metrics, tags=tags)
    ends = [run.info.end_time for run in points if run.info.end_time]
    if ends:  # the parent spans its points in the run list, not the instant it was opened
        client.set_terminated(parent_run_id, RunStatus.to_string(RunStatus.FINISHED), end_time=max(ends))
    return best


def record_rounds(client, experiment: str, rounds_id: str, name: str, summary: Mapping[str, Any]) -> str:
    """Open (or find) the loop's parent run, nest every round's training run under it, log the outcome; its id."""
    from mlflow.entities import Metric, RunTag

    parent = grouping_run(client, experiment, name, {ROUNDS_TAG: rounds_id, ROUNDS_ROLE_TAG: PARENT})
    metrics = []
    for row in summary["rounds"]:
        if row.get("mlflow_run_id"):
            tags = [RunTag(PARENT_RUN_TAG, parent), RunTag(ROUNDS_TAG, rounds_id), RunTag(ROUNDS_ROLE_TAG, "round"),
                    RunTag(ROUND_TAG, str(row["round"]))]
            client.log_batch(row["mlflow_run_id"], tags=tags)
        values = {"return_mean": row["return_mean"], "return_ci95_low": row["return_ci95"][0],
                  "return_ci95_high": row["return_ci95"][1], "score": row["score"],
                  "heldout_ratio": row["heldout_ratio"], "heldout_one_step_ratio": row["heldout_one_step_ratio"],
                  "behaviour_return_mean": summary["behaviour"]["mean"], "random_return_mean": summary["random"]["mean"]}
        metrics += [Metric(ROUNDS_PREFIX + key, float(value), 0, row["round"]) for key, value in values.items()
                    if value is not None]
    metrics = unlogged(client, parent, metrics, lambda m: (m.key, m.step))  # once per round: a rerun adds nothing
    if metrics:
        client.log_batch(parent, metrics=metrics)
    return parent

"""The collect-train loop in MLflow with real environment steps on the "Step" axis.

Each loop's parent run (:func:`worldpipe.tracking.groups.record_rounds`, the round on its step axis) also gets
``env_steps/...`` metrics whose step is the real env steps collected so far: the return (mean, 95% CI), the loop's
wall-clock so far and each round's split (collection, training, evaluation). Across loop seeds, one parent run per
set of loops (found again by its tag) nests the loops' parents and carries ``time_to_quality/...``: the median
return over loops and its CI, and the median wall-clock, against env steps. Every value is logged once per step:
a rerun of the summary adds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.tracking.evaluation import PARENT_RUN_TAG

LOOPS_TAG = "worldpipe.loops.id"
ENV_STEPS_PREFIX = "env_steps/"
TTQ_PREFIX = "time_to_quality/"


def _log_once(client, run_id: str, values: list[tuple[str, float | None, int]]) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(key, float(value), 0, int(step)) for key, value, step in values if value is not None]
    held = {(m.key, m.step) for key in {m.key for m in metrics} for m in client.get_metric_history(run_id, key)}
    metrics = [m for m in metrics if (m.key, m.step) not in held]
    if metrics:
        client.log_batch(run_id, metrics=metrics)


def log_env_steps(client, parent_run_id: str, summary: Mapping[str, Any]) -> None:
    """The loop's outcome on its parent run with real env steps as the step axis."""
    values = []
    for row in summary["rounds"]:
        step, clock = row["env_steps"], row.get("wall_clock_s") or {}
        values += [(ENV_STEPS_PREFIX + "return_mean", row["return_mean"], step),
                   (ENV_STEPS_PREFIX + "return_ci95_low", row["return_ci95"][0], step),
                   (ENV_STEPS_PREFIX + "return_ci95_high", row["return_ci95"][1], step),
                   (ENV_STEPS_PREFIX + "loop_wall_clock_s", row.get("loop_wall_clock_s"), step),
                   *((f"{ENV_STEPS_PREFIX}{part}_s", clock.get(part), step)
                     for part in ("collection", "training", "evaluation"))]
    _log_once(client, parent_run_id, values)


def record_loops(client, loops_id: str, name: str, summary: Mapping[str, Any]) -> str | None:
    """Open (or find) the parent of a set of loops, nest each loop's parent under it, log the median return and
    wall-clock against env steps; its id (None where no loop was recorded in MLflow)."""
    from mlflow.entities import RunStatus, RunTag

    parents = [loop["mlflow_parent_run_id"] for loop in summary["loops"] if loop.get("mlflow_parent_run_id")]
    if not parents:
        return None
    experiment_id = client.get_run(parents[0]).info.experiment_id
    found = client.search_runs([experiment_id], max_results=1, filter_string=f"tags.`{LOOPS_TAG}` = '{loops_id}'")
    if found:
        parent = found[0].info.run_id
    else:
        parent = client.create_run(experiment_id, run_name=name, tags={LOOPS_TAG: loops_id}).info.run_id
        client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED))  # it groups, it does not run
    for run_id in parents:
        client.log_batch(run_id, tags=[RunTag(PARENT_RUN_TAG, parent), RunTag(LOOPS_TAG, loops_id)])
    values = []
    for row in summary["rounds"]:
        step = int(row["env_steps_median"])
        values += [(TTQ_PREFIX + "return_median", row["return"]["median"], step),
                   (TTQ_PREFIX + "return_ci95_low", row["return"]["ci95"][0], step),
                   (TTQ_PREFIX + "return_ci95_high", row["return"]["ci95"][1], step),
                   (TTQ_PREFIX + "loop_wall_clock_median_s", row["loop_wall_clock_median_s"], step)]
    _log_once(client, parent, values)
    return parent

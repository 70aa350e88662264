"""Collection rounds as grouped MLflow runs: one parent per loop, each round's training run nested under it.

The parent is found again by its tag (never created twice for one loop); a round's run is linked by tags only
(``mlflow.parentRunId``), so linking is idempotent. The parent carries the loop's outcome with the round on the
"Step" axis: ``rounds/return_mean`` (and its 95% CI), ``rounds/score`` and ``rounds/heldout_ratio``, plus the
scripted policy's and random's returns on the same seeds; each value is logged once per round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.tracking.connection import unlogged
from worldpipe.tracking.evaluation import PARENT_RUN_TAG, grouping_run

ROUNDS_TAG = "worldpipe.rounds.id"
ROLE_TAG = "worldpipe.rounds.role"  # "parent" on the parent run, "round" on each round's training run
ROUND_TAG = "worldpipe.round"
PREFIX = "rounds/"


def record_rounds(client, experiment: str, rounds_id: str, name: str, summary: Mapping[str, Any]) -> str:
    """Open (or find) the loop's parent run, nest every round's training run under it, log the outcome; its id."""
    from mlflow.entities import Metric, RunTag

    parent = grouping_run(client, experiment, name, {ROUNDS_TAG: rounds_id, ROLE_TAG: "parent"})
    metrics = []
    for row in summary["rounds"]:
        if row.get("mlflow_run_id"):
            client.log_batch(row["mlflow_run_id"], tags=[RunTag(PARENT_RUN_TAG, parent), RunTag(ROUNDS_TAG, rounds_id),
                                                         RunTag(ROLE_TAG, "round"), RunTag(ROUND_TAG, str(row["round"]))])
        values = {"return_mean": row["return_mean"], "return_ci95_low": row["return_ci95"][0],
                  "return_ci95_high": row["return_ci95"][1], "score": row["score"],
                  "heldout_ratio": row["heldout_ratio"], "heldout_one_step_ratio": row["heldout_one_step_ratio"],
                  "behaviour_return_mean": summary["behaviour"]["mean"], "random_return_mean": summary["random"]["mean"]}
        metrics += [Metric(PREFIX + key, float(value), 0, row["round"]) for key, value in values.items()
                    if value is not None]
    metrics = unlogged(client, parent, metrics, lambda m: (m.key, m.step))  # once per round: a rerun adds nothing
    if metrics:
        client.log_batch(parent, metrics=metrics)
    return parent


"""A sweep as grouped MLflow runs: one parent run per sweep, every point's training run nested under it.

The parent is found again by its tags (never created twice for one sweep name in one experiment); a point's
run is linked by tags only (``mlflow.parentRunId`` nests it in the UI), so linking is idempotent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# The experiment is created as training creates it (artifacts beside a SQLite store), whichever comes first.
from worldpipe.tracking.delivery import _experiment_id
from worldpipe.tracking.evaluation import PARENT_RUN_TAG, show_in_model_training_view

SWEEP_TAG = "worldpipe.sweep.name"
ROLE_TAG = "worldpipe.sweep.role"  # "parent" on the parent run, "point" on a point's training run
KEYS_TAG = "worldpipe.sweep.keys"  # parent: JSON list of the swept keys, in order
POINT_TAG = "worldpipe.sweep.point"
VALUE_TAG_PREFIX = "worldpipe.sweep.value."  # point: one tag per swept key
PARENT, POINT = "parent", "point"


def open_parent_run(client, experiment: str, sweep: str, keys: Sequence[str], points: int) -> str:
    """The parent run of sweep ``sweep`` in MLflow experiment ``experiment``, created on first use."""
    from mlflow.entities import RunStatus

    experiment_id = _experiment_id(client, experiment)
    show_in_model_training_view(client, experiment_id)
    found = client.search_runs([experiment_id], max_results=1,
                               filter_string=f"tags.`{SWEEP_TAG}` = '{sweep}' AND tags.`{ROLE_TAG}` = '{PARENT}'")
    if found:
        run_id = found[0].info.run_id
    else:
        run_id = client.create_run(experiment_id, run_name=sweep,
                                   tags={SWEEP_TAG: sweep, ROLE_TAG: PARENT}).info.run_id
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))  # it groups, it does not run
    client.set_tag(run_id, KEYS_TAG, json.dumps(list(keys)))
    client.set_tag(run_id, "worldpipe.sweep.points", str(points))
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
    runs = client.search_runs([parent.info.experiment_id], max_results=10000, filter_string=(
        f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}' AND tags.`{ROLE_TAG}` = '{POINT}'"))
    return sorted(runs, key=lambda r: r.data.tags.get(POINT_TAG, r.info.run_id))


def swept_keys_of(run) -> list[str] | None:
    """The swept keys recorded on a parent run (None: not a sweep parent)."""
    if run.data.tags.get(ROLE_TAG) != PARENT:
        return None
    return json.loads(run.data.tags.get(KEYS_TAG, "[]"))

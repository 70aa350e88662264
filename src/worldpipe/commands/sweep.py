"""`worldpipe sweep ...`: a pipeline config's sweep as points and as grouped MLflow runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    sweep = sub.add_parser("sweep", help="sweeps declared in a pipeline config").add_subparsers(
        dest="sweep_command", required=True)
    points = sweep.add_parser("points", help="print the points of the sweep a pipeline config declares")
    points.add_argument("configfile", help="pipeline config (conf/pipeline/*.yaml) with a `sweep` section")
    points.set_defaults(handler=_points)

    opened = sweep.add_parser("open", help="create (or find) the sweep's MLflow parent run; write its id")
    opened.add_argument("--sweep-json", required=True, help="the config's `sweep` section as JSON")
    opened.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")
    opened.add_argument("--out", required=True, help="JSON record of the parent run to write")
    opened.set_defaults(handler=_open)

    link = sweep.add_parser("link", help="nest a point's training run under the sweep's parent run")
    link.add_argument("--parent", required=True, help="the parent record written by `sweep open`")
    link.add_argument("--done", required=True, help="the point's train_done.json")
    link.add_argument("--point", required=True, help="the point's name")
    link.add_argument("--values-json", required=True, help="the point's swept values as JSON")
    link.add_argument("--tracking-uri")
    link.set_defaults(handler=_link)


def _points(args) -> int:
    from worldpipe.config import paths
    from worldpipe.pipeline.sweep import SweepError, check_sweep, load_pipeline_config

    try:
        config = load_pipeline_config(Path(args.configfile))
        if "sweep" not in config:
            raise SweepError("declares no `sweep`")
        # Checked as the Snakefile checks it: every point composed and validated as a single run.
        points = check_sweep(config, paths.conf_dir())
    except SweepError as err:
        print(f"error: {args.configfile}: {err}", file=sys.stderr)
        return 2
    for point in points:
        print(f"{point.name}\t{' '.join(point.overrides)}")
    return 0


def _open(args) -> int:
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.pipeline.sweep import SweepError, expand_sweep, swept_keys
    from worldpipe.tracking.history import client_for
    from worldpipe.tracking.sweep_runs import open_parent_run

    sweep = json.loads(args.sweep_json)
    try:
        points = expand_sweep(sweep)
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    client = client_for(args.tracking_uri)
    run_id = open_parent_run(client, sweep.get("mlflow_experiment", "worldpipe"), sweep["name"],
                             swept_keys(sweep), len(points))
    record = {"run_id": run_id, "sweep": sweep["name"], "tracking_uri": client.tracking_uri,
              "points": [p.name for p in points]}
    write_text_atomic(Path(args.out), json.dumps(record, indent=2))
    print(f"sweep {sweep['name']}: parent run {run_id}, {len(points)} points")
    return 0


def _link(args) -> int:
    from worldpipe.tracking.history import client_for
    from worldpipe.tracking.sweep_runs import link_point

    parent = json.loads(Path(args.parent).read_text())
    run_id = json.loads(Path(args.done).read_text()).get("mlflow_run_id")
    if not run_id:
        print(f"error: {args.done} records no MLflow run (trained without tracking?)", file=sys.stderr)
        return 2
    link_point(client_for(args.tracking_uri), parent["run_id"], run_id, parent["sweep"], args.point,
               json.loads(args.values_json))
    return 0

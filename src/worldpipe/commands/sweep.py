"""`worldpipe sweep ...`: a pipeline config's sweep as points and as grouped MLflow runs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from worldpipe.commands import command, group


def register(cli: click.Group) -> None:
    sweep = group("sweep", "sweeps declared in a pipeline config")
    tracking_uri = click.Option(["--tracking-uri"], help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")
    for cmd in (
        command("points", _points, "Print the points of the sweep a pipeline config declares.\n\n"
                "CONFIGFILE: pipeline config (conf/pipeline/*.yaml) with a `sweep` section.",
                [click.Argument(["configfile"])], short="print the points of the sweep a pipeline config declares"),
        command("open", _open, "Create (or find) the sweep's MLflow parent run; write its id.", [
            click.Option(["--sweep-json"], required=True, help="the config's `sweep` section as JSON"), tracking_uri,
            click.Option(["--out"], required=True, help="JSON record of the parent run to write")], plumbing=True),
        command("summarize", _summarize, "Record the best point (its metrics and name) on the parent run.", [
            click.Option(["--parent"], required=True, help="the parent record written by `sweep open`"),
            click.Option(["--metric"], help="lowest wins (default: the comparison's metric)"), tracking_uri]),
        command("link", _link, "Nest a point's training run under the sweep's parent run.", [
            click.Option(["--parent"], required=True, help="the parent record written by `sweep open`"),
            click.Option(["--done"], required=True, help="the point's train_done.json"),
            click.Option(["--point"], required=True, help="the point's name"),
            click.Option(["--values-json"], required=True, help="the point's swept values as JSON"), tracking_uri], plumbing=True),
    ):
        sweep.add_command(cmd)
    cli.add_command(sweep)


def _points(args) -> int:
    from worldpipe.config import paths
    from worldpipe.pipeline.sweep import SweepError, check_sweep, load_pipeline_config

    try:
        config = load_pipeline_config(Path(args.configfile))
        if "sweep" not in config:
            raise SweepError("declares no `sweep`")
        # Checked as the Snakefile checks it: every point composed and validated as a single run.
        points = check_sweep(config, paths.conf_dir())
    except SweepError as err:  # a usage error (exit 2), named by the file it is in
        raise SweepError(f"{args.configfile}: {err}") from None
    for point in points:
        print(f"{point.name}\t{' '.join(point.overrides)}")
    return 0


def _open(args) -> int:
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.pipeline.sweep import SweepError, expand_sweep, swept_keys
    from worldpipe.tracking.connection import client_for
    from worldpipe.tracking.groups import open_parent_run

    try:
        sweep = json.loads(args.sweep_json)
    except ValueError as err:
        raise SweepError(f"--sweep-json: not JSON ({err}); give the pipeline config's `sweep` section") from None
    points = expand_sweep(sweep)  # SweepError: a usage error (exit 2)
    client = client_for(args.tracking_uri)
    keys = swept_keys(sweep)
    values = {key: list({json.dumps(p.as_dict().get(key)): p.as_dict().get(key) for p in points}.values())
              for key in keys}
    run_id = open_parent_run(client, sweep.get("mlflow_experiment", "worldpipe"), sweep["name"], keys, len(points),
                             values)
    record = {"run_id": run_id, "sweep": sweep["name"], "tracking_uri": client.tracking_uri,
              "points": [p.name for p in points]}
    write_text_atomic(Path(args.out), json.dumps(record, indent=2))
    print(f"sweep {sweep['name']}: parent run {run_id}, {len(points)} points: {_parent_link(client, run_id)}")
    return 0


def _parent_link(client, run_id: str) -> str:
    from worldpipe.tracking.links import run_url

    return run_url(str(client.tracking_uri), client.get_run(run_id).info.experiment_id, run_id)


def _summarize(args) -> int:
    from worldpipe.pipeline.sweep import SweepError
    from worldpipe.tracking.comparison import DEFAULT_METRIC, TRAINING_METRICS
    from worldpipe.tracking.connection import client_for
    from worldpipe.tracking.groups import summarize_sweep

    parent = _record("--parent", args.parent, "`worldpipe sweep open --out` writes it")
    client = client_for(args.tracking_uri or parent.get("tracking_uri"))
    metric = args.metric or DEFAULT_METRIC
    best = summarize_sweep(client, parent["run_id"], metric, TRAINING_METRICS)
    if best is None:
        raise SweepError(f"no point of sweep {parent['sweep']} has {metric} yet (evaluate the points first)")
    print(f"sweep {parent['sweep']}: best by lowest {metric}: {best.info.run_name} "
          f"({best.data.metrics[metric]:.4g}): {_parent_link(client, parent['run_id'])}")
    return 0


def _record(option: str, path: str, writer: str) -> dict:
    """The JSON record an option names; one line (exit 2) where it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        from worldpipe.pipeline.sweep import SweepError

        raise SweepError(f"{option} {path}: not a readable JSON record ({getattr(err, 'strerror', None) or err}); "
                         f"{writer}") from None


def _link(args) -> int:
    from worldpipe.tracking.connection import client_for
    from worldpipe.tracking.groups import link_point

    parent = _record("--parent", args.parent, "`worldpipe sweep open --out` writes it")
    run_id = _record("--done", args.done, "training writes it").get("mlflow_run_id")
    if not run_id:
        from worldpipe.pipeline.sweep import SweepError

        raise SweepError(f"{args.done} records no MLflow run (trained without tracking?)")
    link_point(client_for(args.tracking_uri), parent["run_id"], run_id, parent["sweep"], args.point,
               json.loads(args.values_json))
    return 0

"""`worldpipe rounds ...`: the collect-train loop of a pipeline config's `rounds:`, summarised round by round."""

from __future__ import annotations

import json
from pathlib import Path

import click

from worldpipe.commands import command, group


def register(cli: click.Group) -> None:
    rounds = group("rounds", "data-collection rounds (collect with a model, train, collect again)")
    rounds.add_command(command(
        "summarize", _summarize, "Return and held-out error against round, beside the scripted policy and random: "
        "a JSON table, a plot, and the rounds as nested MLflow runs under one parent.", [
            click.Option(["--rounds-json"], required=True,
                         help="per round: round, run_dir, metrics (open loop), control (closed loop), manifest"),
            click.Option(["--name"], required=True, help="the parent MLflow run's name"),
            click.Option(["--id", "rounds_id"], required=True, help="the loop's identity (results/rounds/<id>)"),
            click.Option(["--out"], required=True, help="JSON summary to write"),
            click.Option(["--plot"], required=True, help="PNG: return against round"),
            click.Option(["--mlflow-experiment"], default="worldpipe", show_default=True),
            click.Option(["--tracking-uri"], help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")]))
    rounds.add_command(command(
        "time-to-quality", _time_to_quality, "Across loop seeds: the return against real env steps and against the "
        "loop's wall-clock (median, 95% CI), with the env's published anchors: a JSON summary, a plot, and one MLflow "
        "parent over the loops' parents.", [
            click.Argument(["summaries"], nargs=-1, required=True),
            click.Option(["--name"], help="the parent MLflow run's name (default: the loops' id)"),
            click.Option(["--id", "loops_id"], required=True, help="the loops' identity (results/rounds/<id>)"),
            click.Option(["--out"], required=True, help="JSON summary to write"),
            click.Option(["--plot"], required=True, help="PNG: return against env steps and wall-clock"),
            click.Option(["--tracking-uri"], help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db; '' skips"),
            click.Option(["--docs"], metavar="DIR", help="also write the figure for the docs into DIR, with a JSON "
                         "record beside it naming every loop's runs (needs --config)"),
            click.Option(["--config", "config_file"], metavar="FILE",
                         help="the pipeline config the loops were planned from (recorded with --docs)")]))
    cli.add_command(rounds)


def _summarize(args) -> int:
    from worldpipe.control.rounds_report import plot_rounds, summarize_rounds, table
    from worldpipe.core.atomic import write_text_atomic

    try:
        records = json.loads(args.rounds_json)
    except ValueError as err:
        from worldpipe.core.errors import UsageError

        raise UsageError(f"--rounds-json: not JSON ({err}); the pipeline's summarize_rounds rule writes it") from None
    summary = summarize_rounds(records)
    if args.tracking_uri != "":
        from worldpipe.control.loop_records import log_env_steps
        from worldpipe.tracking.connection import client_for
        from worldpipe.tracking.groups import record_rounds

        client = client_for(args.tracking_uri)
        summary["mlflow_parent_run_id"] = record_rounds(client, args.mlflow_experiment, args.rounds_id, args.name,
                                                        summary)
        log_env_steps(client, summary["mlflow_parent_run_id"], summary)
    plot_rounds(summary, args.plot)
    write_text_atomic(Path(args.out), json.dumps(summary, indent=1, sort_keys=True))
    print(table(summary))
    return 0


def _time_to_quality(args) -> int:
    from worldpipe.control.time_to_quality import plot_time_to_quality, summarize_loops, table
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.core.errors import UsageError

    summaries = []
    for file in args.summaries:
        try:
            summaries.append(json.loads(Path(file).read_text()))
        except (OSError, ValueError) as err:
            raise UsageError(f"{file}: not a loop's summary ({type(err).__name__}: {err}); `worldpipe rounds "
                             "summarize` writes one (the pipeline's summarize_rounds rule)") from None
    try:
        summary = summarize_loops(summaries)
    except (KeyError, ValueError) as err:
        raise UsageError(f"time-to-quality: {err}") from None
    summary["summaries"] = list(args.summaries)
    if args.tracking_uri != "":
        from worldpipe.control.loop_records import record_loops
        from worldpipe.tracking.connection import client_for

        summary["mlflow_parent_run_id"] = record_loops(client_for(args.tracking_uri), args.loops_id,
                                                       args.name or args.loops_id, summary)
    plot_time_to_quality(summary, args.plot)
    write_text_atomic(Path(args.out), json.dumps(summary, indent=1, sort_keys=True))
    if args.docs:
        if not args.config_file:
            raise UsageError("--docs needs --config: the pipeline config the loops were planned from")
        _docs_figure(summary, summaries, args)
    print(table(summary))
    return 0


def _docs_figure(summary: dict, summaries: list[dict], args) -> None:
    """The figure for the docs and its record: the command, the config, every loop's runs, the numbers drawn."""
    from worldpipe.control.time_to_quality import plot_time_to_quality
    from worldpipe.core.atomic import write_text_atomic

    name = "time-to-quality-" + summary["env_id"].replace("dm_control/", "dmc-").replace("/", "-").lower()
    figure = Path(args.docs) / f"{name}.png"
    plot_time_to_quality(summary, figure)
    command = ["worldpipe rounds time-to-quality", *args.summaries, f"--id {args.loops_id}", f"--docs {args.docs}",
               f"--config {args.config_file}"]
    record = {
        "command": " ".join(command), "config": args.config_file, "env_id": summary["env_id"],
        "loops": [[{key: row[key] for key in ("round", "run_hash", "control_hash", "mlflow_run_id",
                                               "checkpoint_digest", "env_steps", "return_mean", "return_ci95")}
                   for row in loop["rounds"]] for loop in summaries],
        "values": {"rounds": summary["rounds"], "random": summary["random"], "ceiling": summary["ceiling"],
                   "quality": summary["quality"], "anchors": summary["anchors"], "ci": summary["ci"]},
    }
    write_text_atomic(figure.with_suffix(".json"), json.dumps(record, indent=1, sort_keys=True))

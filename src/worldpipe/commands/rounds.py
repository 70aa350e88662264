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
        from worldpipe.tracking.connection import client_for
        from worldpipe.tracking.rounds_runs import record_rounds

        summary["mlflow_parent_run_id"] = record_rounds(client_for(args.tracking_uri), args.mlflow_experiment,
                                                        args.rounds_id, args.name, summary)
    plot_rounds(summary, args.plot)
    write_text_atomic(Path(args.out), json.dumps(summary, indent=1, sort_keys=True))
    print(table(summary))
    return 0

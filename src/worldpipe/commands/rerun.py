"""`worldpipe rerun RUN_ID` and `worldpipe resume RUN_ID --step N`: rebuild runs from their MLflow records."""

from __future__ import annotations

import click

from worldpipe.commands import command, overrides
from worldpipe.core import numerics


def _common() -> list[click.Parameter]:
    return [
        click.Argument(["run_id"], metavar="RUN_ID"),
        click.Option(["--tracking-uri"], help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db"),
        click.Option(["--allow-code-drift"], is_flag=True,
                     help="proceed although code or packages differ from the recorded ones (recorded as a tag)"),
        click.Option(["--run-dir"], help="new run directory (default: results/runs/<experiment>-<kind>-<id>-<time>)"),
        click.Option(["--data-dir"], help="where to find or regenerate the dataset if not at its recorded path"),
    ]


def register(cli: click.Group) -> None:
    cli.add_command(command("rerun", _rerun, "Retrain a recorded run from MLflow alone and compare: bit-identical? "
                            "On another numerics environment, judged within tolerance. (exit 0 identical, 1 "
                            "different or failed, 2 cannot be rerun as recorded, 3 equivalent on a different numerics environment)", [
        *_common(),
        click.Option(["--rtol"], type=click.FloatRange(min=0), default=numerics.DEFAULT_RTOL, show_default=True,
                     help="on another numerics environment: largest relative difference of any metric value"),
        click.Option(["--ratio-tol"], type=click.FloatRange(min=0), default=numerics.DEFAULT_RATIO_TOL,
                     show_default=True,
                     help="on another numerics environment: relative difference of the final models' open-loop "
                          "error ratios"),
        click.Option(["--regenerate-data"], is_flag=True,
                     help="build the dataset again from its records even where it is on disk (a collection round's "
                          "data: played again by its recorded collecting model) and require the recorded hash"),
        click.Option(["--chain"], is_flag=True,
                     help="a collection round whose collecting run (or its data) is gone: rebuild those first from "
                          "their own MLflow records, back to round 0, each bit for bit")]))
    cli.add_command(command("resume", _resume, "Continue a recorded run from one of its checkpoints into a new run "
                            "dir (resume-safe Hydra overrides may follow, e.g. trainer.steps=200).", [
        *_common(), click.Option(["--step"], type=click.IntRange(min=0), required=True,
                                  help="recorded checkpoint step to continue from"),
        overrides()], pass_on=True))


def _rerun(args) -> int:
    from worldpipe.reproduce.rerun import Tolerance, rerun

    return rerun(args.run_id, args.tracking_uri, args.allow_code_drift, args.run_dir, args.data_dir,
                 Tolerance(args.rtol, args.ratio_tol), args.regenerate_data, args.chain)


def _resume(args) -> int:
    from worldpipe.reproduce.continuation import resume

    return resume(args.run_id, args.step, args.tracking_uri, args.allow_code_drift, args.run_dir, args.data_dir,
                  list(args.overrides))

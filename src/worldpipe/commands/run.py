"""`worldpipe train` and `worldpipe evaluate`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from worldpipe.commands import (
    RUN_TEXT,
    checkpoints_option,
    command,
    handled,
    locate,
    pin_recorded_numerics,
    run_argument,
)
from worldpipe.core.atomic import write_text_atomic


def register(cli: click.Group) -> None:
    # `worldpipe train ...` never reaches click (worldpipe.cli hands it to the Hydra app, commands/train.py, whose
    # --help is Hydra's); registered so that `worldpipe --help` lists it and completion names it.
    cli.add_command(click.Command(
        "train", callback=handled(_train), params=[click.Argument(
            ["overrides"], nargs=-1, type=click.UNPROCESSED, metavar="[HYDRA FLAGS AND OVERRIDES]...",
            shell_complete=_complete_overrides)],
        help="Train under torchrun: a Hydra app (overrides such as trainer.steps=100, --cfg job, --help, -m).",
        short_help="train under torchrun: a Hydra app (trainer.steps=100, --cfg job, --help, -m)", options_metavar="",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}))
    cli.add_command(command("evaluate", _evaluate, "Open-loop prediction error vs the repeat-last-observation "
                            f"baseline.\n\n{RUN_TEXT}", [
        run_argument(required=False), checkpoints_option(),
        click.Option(["--store"], required=True, help="held-out trajectory store (path or URL)"),
        click.Option(["--manifest"], required=True, help="held-out dataset manifest.json"),
        click.Option(["--context"], type=click.IntRange(min=1), default=8, show_default=True, help="context steps"),
        click.Option(["--horizon"], type=click.IntRange(min=1), default=16, show_default=True,
                     help="open-loop steps predicted"),
        click.Option(["--out"], required=True, help="metrics JSON to write"),
        click.Option(["--plot"], help="error-vs-horizon PNG to write"),
        click.Option(["--predictions"], help="npz to write: held-out inputs and open-loop predictions"),
        click.Option(["--pictures"], help="folder to write pictures of the imagination to (frame grids and GIFs "
                                          "for frame models, trajectory bands for state models)"),
        click.Option(["--tracking-uri"], help="MLflow to log to (default: the run's recorded URI, "
                                              "$MLFLOW_TRACKING_URI, results/mlflow.db)"),
        click.Option(["--no-tracking"], is_flag=True, help="do not log the evaluation or the model to MLflow"),
        click.Option(["--register-as"], help="register the model under this name (default: tracking.register_as)"),
    ]))


def _complete_overrides(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Hydra's completion of `worldpipe train`'s overrides (groups, options, keys), for click's completion script:
    the same answers as the script of `worldpipe train -sc install=bash`."""
    import contextlib
    import io
    import os

    from worldpipe.commands.train import complete

    before = os.environ.get("COMP_LINE")
    os.environ["COMP_LINE"] = " ".join(["worldpipe", "train", *(ctx.params.get("overrides") or ()), incomplete])
    answer = io.StringIO()
    try:
        with contextlib.redirect_stdout(answer):
            complete(["-sc", "query=bash"], ())
    finally:
        if before is None:
            os.environ.pop("COMP_LINE", None)
        else:
            os.environ["COMP_LINE"] = before
    return answer.getvalue().split()


def _train(args) -> int:
    from worldpipe.commands.train import launch

    return launch(args.overrides)


def _evaluate(args) -> int:
    where = locate(args)
    pin_recorded_numerics(where)  # the evaluated run's code paths, before torch computes
    from worldpipe.evaluate.open_loop import evaluate, plot_error_vs_horizon

    with tempfile.TemporaryDirectory(prefix="worldpipe-eval-") as tmp:
        predictions = args.predictions or str(Path(tmp) / "predictions.npz")
        result = evaluate(where.root, args.store, args.manifest, args.context, args.horizon, predictions, where.step)
        write_text_atomic(Path(args.out), json.dumps(result, indent=2))
        if args.plot:
            plot_error_vs_horizon(result, args.plot)
        pictures = _pictures(args, where.root, result["checkpoint_step"], predictions)
        print(f"one-step MSE ratio (model / repeat-last): {result['one_step_ratio']:.4f} "
              f"over {result['segments']} segments")
        if "pixel_ratio" in result:
            print(f"pixel MSE ratio (model / repeat-last frame): horizon 1 {result['pixel_ratio'][0]:.4f}, "
                  f"horizon {result['horizon']} {result['pixel_ratio'][-1]:.4f}")
        if not args.no_tracking:
            return _track_evaluation(args, where.root, result, predictions, pictures)
    return 0


def _pictures(args, root: str, step: int, predictions: str) -> dict[str, str]:
    """Draw the pictures (``--pictures``) of checkpoint ``step`` from the predictions file; {name: path} of the
    files written."""
    if not args.pictures:
        return {}
    from worldpipe.evaluate.open_loop import load_model
    from worldpipe.evaluate.pictures import write_pictures

    model, _ = load_model(root, step)
    return {path.stem: str(path) for path in write_pictures(model, predictions, args.context, args.pictures)}


def _track_evaluation(args, root: str, result: dict, predictions: str, pictures: dict[str, str]) -> int:
    from worldpipe.evaluate.record import EvaluationInputs, record_evaluation

    files = {"metrics": args.out, **({"plot": args.plot} if args.plot else {}), **pictures}
    inputs = EvaluationInputs(root, args.store, args.manifest, files, predictions)
    try:
        recorded = record_evaluation(result, inputs, args.tracking_uri, args.register_as)
    except Exception as err:  # noqa: BLE001 - any MLflow failure: one line, the files are written
        print(f"error: logging the evaluation to MLflow failed ({type(err).__name__}: {err}); {args.out} is "
              "written; run the same command again to log it (nothing is logged twice)", file=sys.stderr)
        return 1
    if recorded:
        print(f"logged to MLflow run {recorded.run_id}: {recorded.run_url}")
        if recorded.model_url:
            print(f"logged model: {recorded.model_url}")
    return 0

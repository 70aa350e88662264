"""`worldpipe train` and `worldpipe evaluate`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from worldpipe.core.atomic import write_text_atomic


def register(sub) -> None:
    # `worldpipe train ...` never reaches argparse (worldpipe.cli hands it to the Hydra app, commands/train.py);
    # registered so that `worldpipe --help` lists it.
    train = sub.add_parser("train", help="train under torchrun: a Hydra app (overrides such as trainer.steps=100, "
                                         "--cfg job, --help, -m)")
    train.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    train.set_defaults(handler=_train, accepts_overrides=True)

    ev = sub.add_parser("evaluate", help="open-loop prediction error vs the repeat-last-observation baseline")
    ev.add_argument("--checkpoints", required=True, help="checkpoint directory of the run")
    ev.add_argument("--store", required=True, help="held-out trajectory store (path or URL)")
    ev.add_argument("--manifest", required=True, help="held-out dataset manifest.json")
    ev.add_argument("--context", type=int, default=8)
    ev.add_argument("--horizon", type=int, default=16)
    ev.add_argument("--out", required=True, help="metrics JSON to write")
    ev.add_argument("--plot", help="error-vs-horizon PNG to write")
    ev.add_argument("--predictions", help="npz to write: held-out inputs and open-loop predictions")
    ev.add_argument("--tracking-uri", help="MLflow to log to (default: the run's recorded URI, "
                                           "$MLFLOW_TRACKING_URI, results/mlflow.db)")
    ev.add_argument("--no-tracking", action="store_true", help="do not log the evaluation or the model to MLflow")
    ev.add_argument("--register-as", help="register the model under this name (default: tracking.register_as)")
    ev.set_defaults(handler=_evaluate)


def _train(args) -> int:
    from worldpipe.commands.train import launch

    return launch(args.overrides)


def _evaluate(args) -> int:
    from worldpipe.evaluate.open_loop import evaluate, plot_error_vs_horizon

    with tempfile.TemporaryDirectory(prefix="worldpipe-eval-") as tmp:
        predictions = args.predictions or str(Path(tmp) / "predictions.npz")
        result = evaluate(args.checkpoints, args.store, args.manifest, args.context, args.horizon, predictions)
        write_text_atomic(Path(args.out), json.dumps(result, indent=2))
        if args.plot:
            plot_error_vs_horizon(result, args.plot)
        print(f"one-step MSE ratio (model / repeat-last): {result['one_step_ratio']:.4f} "
              f"over {result['segments']} segments")
        if not args.no_tracking:
            return _track_evaluation(args, result, predictions)
    return 0


def _track_evaluation(args, result: dict, predictions: str) -> int:
    from worldpipe.evaluate.record import EvaluationInputs, record_evaluation

    files = {"metrics": args.out, **({"plot": args.plot} if args.plot else {})}
    inputs = EvaluationInputs(args.checkpoints, args.store, args.manifest, files, predictions)
    try:
        run_id = record_evaluation(result, inputs, args.tracking_uri, args.register_as)
    except Exception as err:  # noqa: BLE001 - any MLflow failure: one line, the files are written
        print(f"error: logging the evaluation to MLflow failed ({type(err).__name__}: {err}); {args.out} is "
              "written; run the same command again to log it (nothing is logged twice)", file=sys.stderr)
        return 1
    if run_id:
        print(f"logged to MLflow run {run_id}")
    return 0

"""`worldpipe train` and `worldpipe evaluate`."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from worldpipe.core.atomic import write_text_atomic

# A multi-node run started by hand: every node's `worldpipe train` joins this rendezvous.
RDZV_ENDPOINT_ENV, RDZV_ID_ENV = "WORLDPIPE_RDZV_ENDPOINT", "WORLDPIPE_RDZV_ID"


def register(sub) -> None:
    train = sub.add_parser("train", help="train under torchrun (Hydra overrides follow, e.g. trainer.steps=100); "
                                         "in a SLURM batch step, as a job step of its own on parallel.nnodes nodes")
    train.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    train.add_argument("--dataset-spec-hash", help="(pipeline) the run directory must be named by the hash of this "
                       "config and this dataset spec; the attempt and how it ended go into its run.json")
    train.add_argument("--rdzv-endpoint", default=os.environ.get(RDZV_ENDPOINT_ENV) or None,
                       help=f"HOST:PORT of the nodes' c10d rendezvous (multi-node; default ${RDZV_ENDPOINT_ENV})")
    train.add_argument("--rdzv-id", default=os.environ.get(RDZV_ID_ENV) or None,
                       help=f"id the nodes of one run share (default ${RDZV_ID_ENV}, else 'worldpipe')")
    train.add_argument("--snakemake-rule", help="tag the MLflow run with the Snakemake rule that started it")
    train.add_argument("--snakemake-job", help="tag the MLflow run with the Snakemake job (experiment, point)")
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
    # Imported here, not at the top: with numpy they cost every other command ~0.15 s of start-up.
    from worldpipe.launch.launcher import prepared_config, start_training
    from worldpipe.tracking.records import JOB_ENV, RULE_ENV

    # Read by the trainer's tracking records, in this process and in its workers.
    for name, value in ((RULE_ENV, args.snakemake_rule), (JOB_ENV, args.snakemake_job)):
        if value:
            os.environ[name] = value
    if args.dataset_spec_hash is None:
        return start_training(args.overrides, args.rdzv_endpoint, args.rdzv_id)
    from worldpipe.core.errors import EXIT_FAILURE, classify
    from worldpipe.pipeline.run_index import begin, end

    cfg = prepared_config(args.overrides)  # composed once: the run directory's check and the launch share it
    record = begin(cfg.run_dir, args.dataset_spec_hash, args.overrides, cfg)
    print(f"run {record['experiment']}/{record['run_hash']}: attempt {len(record['attempts'])}", flush=True)
    code = EXIT_FAILURE
    try:
        code = start_training(args.overrides, args.rdzv_endpoint, args.rdzv_id, cfg)
    except Exception as err:
        code = classify(err) or EXIT_FAILURE
        raise
    finally:
        end(cfg.run_dir, code)
    return code


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

"""`worldpipe rerun RUN_ID` and `worldpipe resume RUN_ID --step N`: rebuild runs from their MLflow records."""

from __future__ import annotations


def _common(parser) -> None:
    parser.add_argument("run_id", metavar="RUN_ID")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")
    parser.add_argument("--allow-code-drift", action="store_true",
                        help="proceed although code or packages differ from the recorded ones (recorded as a tag)")
    parser.add_argument("--run-dir", help="new run directory (default: results/runs/<experiment>-<kind>-<id>-<time>)")
    parser.add_argument("--data-dir", help="where to find or regenerate the dataset if not at its recorded path")


def register(sub) -> None:
    rerun = sub.add_parser("rerun", help="retrain a recorded run from MLflow alone and compare: bit-identical? "
                                         "(exit 0 identical, 1 different, 2 error)")
    _common(rerun)
    rerun.set_defaults(handler=_rerun)

    resume = sub.add_parser("resume", help="continue a recorded run from one of its checkpoints into a new run dir "
                                           "(resume-safe Hydra overrides may follow, e.g. trainer.steps=200)")
    _common(resume)
    resume.add_argument("--step", type=int, required=True, help="recorded checkpoint step to continue from")
    resume.add_argument("overrides", nargs="*", help="Hydra overrides of resume-safe keys")
    resume.set_defaults(handler=_resume, accepts_overrides=True)


def _rerun(args) -> int:
    from worldpipe.reproduce.rerun import rerun

    return rerun(args.run_id, args.tracking_uri, args.allow_code_drift, args.run_dir, args.data_dir)


def _resume(args) -> int:
    from worldpipe.reproduce.continuation import resume

    return resume(args.run_id, args.step, args.tracking_uri, args.allow_code_drift, args.run_dir, args.data_dir,
                  list(args.overrides))

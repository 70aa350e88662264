"""`worldpipe runs ...`: the config-addressed runs of each experiment (list), and the pipeline's run records."""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    runs = sub.add_parser("runs", help="runs of each experiment: config hash, status, MLflow run, what changed")
    cmds = runs.add_subparsers(dest="runs_command", required=True)

    ls = cmds.add_parser("list", help="every run of each experiment, oldest first")
    ls.add_argument("experiments", nargs="*", help="only these experiments (default: all)")
    ls.add_argument("--runs-dir", help="default: `runs` of conf/paths/default.yaml (results/runs)")
    ls.set_defaults(handler=_list)

    begin = cmds.add_parser("begin", help="(pipeline) record an attempt at RUN_DIR and point `latest` at it")
    begin.add_argument("run_dir")
    begin.add_argument("--dataset-spec-hash", required=True, help="spec hash of the training dataset")
    begin.add_argument("overrides", nargs="*", help="the Hydra overrides the training gets")
    begin.set_defaults(handler=_begin, accepts_overrides=True)

    end = cmds.add_parser("end", help="(pipeline) record how the newest attempt at RUN_DIR ended")
    end.add_argument("run_dir")
    end.add_argument("--exit-code", type=int, required=True)
    end.set_defaults(handler=_end)


def _list(args) -> int:
    from worldpipe.config import paths
    from worldpipe.pipeline.run_index import config_changes, experiment_runs

    root = Path(args.runs_dir or paths.layout()["runs"])
    if not root.is_dir():
        print(f"error: no runs directory {root}", file=sys.stderr)
        return 1
    names = args.experiments or sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    missing = [name for name in names if not (root / name).is_dir()]
    if missing:
        print(f"error: no runs of {', '.join(missing)} under {root}", file=sys.stderr)
        return 1
    for name in names:
        print(name)
        previous = None
        for run in experiment_runs(root / name):
            mark = f"  <- {paths.LATEST_LINK}" if run.is_latest else ""
            print(f"  {run.path.name}  {run.record.get('started_at', '?'):<25}  {run.status:<40}  "
                  f"mlflow {run.mlflow_run_id or '-'}{mark}")
            changes = config_changes(previous, run.record) if previous is not None else ["(first run)"]
            for line in changes or ["(same identity as the previous run)"]:
                print(f"      {line}")
            previous = run.record
    return 0


def _begin(args) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from worldpipe.launch.run_lock import RunLocked
    from worldpipe.pipeline.run_index import RunDirMismatch, begin

    try:
        record = begin(args.run_dir, args.dataset_spec_hash, args.overrides)
    except (RunDirMismatch, RunLocked, HydraException, OmegaConfBaseException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run {record['experiment']}/{record['run_hash']}: attempt {len(record['attempts'])}")
    return 0


def _end(args) -> int:
    from worldpipe.pipeline.run_index import end

    end(args.run_dir, args.exit_code)
    return 0

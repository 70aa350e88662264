"""`worldpipe runs ...`: the config-addressed runs of each experiment (list), and the pipeline's run records."""

from __future__ import annotations

from pathlib import Path

import click

from worldpipe.commands import command, group, overrides
from worldpipe.core.errors import UsageError


def register(cli: click.Group) -> None:
    runs = group("runs", "runs of each experiment: config hash, status, MLflow run, what changed")
    runs_dir = click.Option(["--runs-dir"], help="default: `runs` of conf/paths/default.yaml (results/runs)")
    for cmd in (
        command("list", _list, "Every run of each experiment, oldest first.\n\n"
                "EXPERIMENTS: only these experiments (default: all).",
                [click.Argument(["experiments"], nargs=-1), runs_dir], short="every run of each experiment"),
        command("status", _status, "Running and recently ended trainings: step, loss, steps/s, ETA.\n\n"
                "RUN_DIRS: these run directories (default: every run and sweep point).", [
                    click.Argument(["run_dirs"], nargs=-1), runs_dir,
                    click.Option(["--sweeps-dir"], help="default: `sweeps` of conf/paths/default.yaml "
                                                       "(results/sweeps)"),
                    click.Option(["--recent"], type=float, default=60.0, metavar="MINUTES", show_default=True,
                                 help="also show runs that ended within this many minutes"),
                    click.Option(["--watch"], type=float, default=None, metavar="SECONDS",
                                 help="show the table again every SECONDS until no run is running (or Ctrl-C)")],
                short="running and recently ended trainings: step, loss, steps/s, ETA"),
        command("begin", _begin, "(pipeline) Record an attempt at RUN_DIR and point `latest` at it.\n\n"
                "OVERRIDES: the Hydra overrides the training gets.", [
                    click.Argument(["run_dir"]),
                    click.Option(["--dataset-spec-hash"], required=True, help="spec hash of the training dataset"),
                    overrides()], pass_on=True, short="(pipeline) record an attempt at RUN_DIR", plumbing=True),
        command("end", _end, "(pipeline) Record how the newest attempt at RUN_DIR ended.", [
            click.Argument(["run_dir"]), click.Option(["--exit-code"], type=int, required=True,
                                                      help="the training's exit status")], plumbing=True),
    ):
        runs.add_command(cmd)
    cli.add_command(runs)


def _list(args) -> int:
    from worldpipe.config import paths
    from worldpipe.pipeline.run_index import (
        config_changes,
        control_line,
        experiment_runs,
        numerics_lines,
        rebuilt_line,
    )

    root = Path(args.runs_dir or paths.layout()["runs"])
    if not root.is_dir():
        raise UsageError(f"no runs directory {root} (train a run first, or give --runs-dir)")
    names = args.experiments or sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    missing = [name for name in names if not (root / name).is_dir()]
    if missing:
        raise UsageError(f"no runs of {', '.join(missing)} under {root}")
    for name in names:
        print(name)
        previous = None
        for run in experiment_runs(root / name):
            mark = f"  <- {paths.LATEST_LINK}" if run.is_latest else ""
            print(f"  {run.path.name}  {run.record.get('started_at', '?'):<25}  {run.status:<40}  "
                  f"mlflow {run.mlflow_run_id or '-'}{mark}")
            rebuilt = rebuilt_line(run.record)
            if rebuilt is not None:  # not a config of its own: said against its source, not the previous run
                lines = [rebuilt]
            else:
                changes = config_changes(previous, run.record) if previous is not None else ["(first run)"]
                lines = changes or ["(same identity as the previous run)"]
                previous = run.record
            for line in [*lines, *filter(None, [control_line(run.path)]), *numerics_lines(run.path)]:
                print(f"      {line}")
    return 0


def _status(args) -> int:
    import time

    if args.watch is not None and args.watch <= 0:
        raise UsageError(f"--watch takes a number of seconds > 0, got {args.watch:g}")
    while True:
        code, running = _status_table(args)
        if args.watch is None or code != 0 or not running:
            return code
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        print()


def _status_table(args) -> tuple[int, bool]:
    """Print the table once; (exit status, whether any listed run is still running)."""
    import time

    from worldpipe.config import paths
    from worldpipe.pipeline.run_index import last_progress, progress_run_dirs, rebuilt_line, run_status

    layout = paths.layout()
    if args.run_dirs:
        dirs = [Path(d) for d in args.run_dirs]
        missing = [str(d) for d in dirs if last_progress(d) is None]
        if missing:
            raise UsageError(f"no progress record ({paths.PROGRESS_RECORD}) in {', '.join(missing)}")
    else:
        dirs = progress_run_dirs([Path(args.runs_dir or layout["runs"]), Path(args.sweeps_dir or layout["sweeps"])])
    now, rows, any_running = time.time(), [], False
    for run_dir in dirs:
        progress = last_progress(run_dir)
        record = _json_or_empty(run_dir / paths.RUN_RECORD)
        state = run_status(run_dir, record)
        rebuilt = rebuilt_line(record, with_verdict=False)
        if rebuilt is not None:
            state += f" ({rebuilt})"
        running = state.startswith("running")
        any_running = any_running or running
        if progress is None or not (args.run_dirs or running or now - progress["time"] <= args.recent * 60):
            continue
        rows.append(_status_row(run_dir, progress, state, running, now))
    if not rows:
        print(f"no training running or ended in the last {args.recent:g} minutes")
        return 0, False
    header = ("RUN", "STEP", "LOSS", "STEPS/S", "ETA", "UPDATED", "STATE")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0, any_running


def _json_or_empty(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


def _status_row(run_dir: Path, progress: dict, state: str, running: bool, now: float) -> tuple[str, ...]:
    """One line of `runs status`: the ETA only while running (the steps left at the last measured speed)."""
    step, target, speed = progress["step"], progress.get("target_steps"), progress.get("steps_per_s") or 0.0
    left = (target - step) / speed if running and target and speed > 0 else None
    eta = _duration(left) if left is not None else "-"
    return (str(run_dir), f"{step}/{target}", f"{progress.get('loss', float('nan')):.4g}", f"{speed:.3g}", eta,
            _duration(now - progress["time"]) + " ago", state)


def _begin(args) -> int:
    from worldpipe.pipeline.run_index import begin

    # A run directory in use is exit 1, as `worldpipe train` says it; a config or directory that does not fit, 2.
    record = begin(args.run_dir, args.dataset_spec_hash, args.overrides)
    print(f"run {record['experiment']}/{record['run_hash']}: attempt {len(record['attempts'])}")
    return 0


def _end(args) -> int:
    from worldpipe.pipeline.run_index import end

    end(args.run_dir, args.exit_code)
    return 0

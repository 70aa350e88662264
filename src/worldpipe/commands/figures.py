"""`worldpipe figures`: the documentation's figures, made again from the pipeline runs they name.

Each figure is drawn from the current config's run of every experiment (the runs `make pipeline` leaves in
results/), labels each run with its run hash, and gets a JSON file beside it (``<figure>.json``) that names the
command, the config, each run (experiment, run hash, MLflow run id, checkpoint digest, the record it read, the
numerics environment it was trained on) and every number it plots. tests/project/test_docs_figures.py holds the
committed figures to the current config's plan; the slow default-pipeline test holds their numbers to a fresh run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from worldpipe.commands import command

DEFAULT_CONFIG = "conf/pipeline/default.yaml"
OPEN_LOOP_FIGURE = "models-vs-baseline"
CLOSED_LOOP_FIGURE = "control-overview"


def register(cli: click.Group) -> None:
    cli.add_command(command("figures", _figures, "Draw the documentation's figures again from the runs of a pipeline "
                            "config (run `make pipeline` first), each with a JSON file naming its runs and numbers.", [
        click.Option(["--configfile"], default=DEFAULT_CONFIG, show_default=True,
                     help="the pipeline config whose current runs are drawn"),
        click.Option(["--out"], default="docs/assets", show_default=True, help="folder for the PNG and JSON files"),
    ], short="draw the documentation's figures again from the runs they name"))


def run_entry(run, record_path: Path, evaluation_hash: str) -> dict[str, Any]:
    """What a figure's JSON says of one run: its address, the evaluation drawn (by its hash), its MLflow run, its
    checkpoint and numerics."""
    from worldpipe.checkpoint.layout import latest_identity
    from worldpipe.config import paths
    from worldpipe.core import numerics

    done = json.loads((Path(run.dir) / paths.COMPLETION_RECORD).read_text())
    identity = latest_identity(paths.checkpoints_dir(run.dir))
    env = identity.get(numerics.IDENTITY_KEY) or {}
    return {"experiment": run.experiment, "run_hash": paths.short(run.run_hash), "run_dir": run.dir,
            "evaluation_hash": paths.short(evaluation_hash),
            "mlflow_run_id": done.get("mlflow_run_id"), "checkpoint_digest": done.get("digest"),
            "record": str(record_path), "numerics": env,
            "numerics_summary": f"{numerics.summary(env)} ({env.get('cpu.model', '?')})"}


def _record(path: Path, what: str) -> dict[str, Any]:
    from worldpipe.core.errors import UsageError

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise UsageError(f"{path}: no {what} of the config's current run (run `make pipeline` first, with the "
                         "same --configfile)") from None


def _figures(args) -> int:
    import yaml

    from worldpipe.config import paths
    from worldpipe.control.report import plot_control_overview
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.evaluate.open_loop import plot_models_vs_baseline
    from worldpipe.pipeline.plan import plan

    try:
        config = yaml.safe_load(Path(args.configfile).read_text())
    except (OSError, yaml.YAMLError) as err:
        from worldpipe.core.errors import UsageError

        raise UsageError(f"--configfile {args.configfile}: cannot read it ({getattr(err, 'strerror', None) or err}); "
                         "give a pipeline config (conf/pipeline/*.yaml)") from None
    _, runs = plan(config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made = {"command": f"worldpipe figures --configfile {args.configfile}", "config": args.configfile}

    open_loop, entries = {}, {}
    for run in runs.values():
        path = Path(run.dir) / paths.EVAL_DIR / paths.short(run.eval_hash) / "metrics.json"
        open_loop[f"{run.experiment} ({paths.short(run.run_hash)})"] = _record(path, "held-out evaluation")
        entries[run.experiment] = run_entry(run, path, run.eval_hash)
    plot_models_vs_baseline(open_loop, out / f"{OPEN_LOOP_FIGURE}.png")
    values = {run.experiment: {"ratio": result["ratio"], "one_step_ratio": result["one_step_ratio"]}
              for run, result in zip(runs.values(), open_loop.values(), strict=True)}
    write_text_atomic(out / f"{OPEN_LOOP_FIGURE}.json",
                      json.dumps({**made, "runs": entries, "values": values}, indent=1) + "\n")
    print(f"{out / OPEN_LOOP_FIGURE}.png: {', '.join(open_loop)}")

    controlled = [run for run in runs.values() if run.control_hash]
    if controlled:
        records, entries = {}, {}
        for run in controlled:
            path = Path(run.dir) / paths.CONTROL_DIR / paths.short(run.control_hash) / "control.json"
            records[f"{run.experiment} ({paths.short(run.run_hash)})"] = _record(path, "closed-loop evaluation")
            entries[run.experiment] = run_entry(run, path, run.control_hash)
        drawn = plot_control_overview(records, out / f"{CLOSED_LOOP_FIGURE}.png")
        values = {run.experiment: drawn[label] for run, label in zip(controlled, records, strict=True)}
        write_text_atomic(out / f"{CLOSED_LOOP_FIGURE}.json",
                          json.dumps({**made, "runs": entries, "values": values}, indent=1) + "\n")
        print(f"{out / CLOSED_LOOP_FIGURE}.png: {', '.join(records)}")
    return 0

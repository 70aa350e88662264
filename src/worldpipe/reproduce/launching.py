"""Training a recorded config again: a new run directory whose first start creates a new MLflow run."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from pathlib import Path

import yaml

from worldpipe.config import paths
from worldpipe.core.atomic import makedirs_durably, write_text_atomic
from worldpipe.launch.launcher import compose_start, launch_training
from worldpipe.reproduce.drift import RerunError
from worldpipe.tracking.history import RecordedRun
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.rerun")

# Hydra's primary config of a rebuilt run: the recorded values win over conf/'s current defaults.
RECORDED_CONFIG_DIR = "rerun_config"


def prepare_run_dir(run_dir: Path, tags: dict[str, str], rebuilt: dict, copy_history: tuple[str, int] | None = None
                    ) -> None:
    """Tell the run directory's recorder to create a new MLflow run (with these tags) at its first start, and
    record what the directory holds (``rebuilt``: what kind of rebuild, of which run) in its run record, so that
    `worldpipe runs list/status` show it as a rerun of its source."""
    spool = Spool(run_dir)
    if spool.journal.exists():
        raise RerunError(f"{run_dir} already holds a recorded run; pick a new --run-dir")
    with spool.locked():
        state = spool.state()
        state["new_run"] = {"tags": tags}
        if copy_history:
            state["new_run"].update(copy_history_from=copy_history[0], through_step=int(copy_history[1]))
        spool.save_state(state)
    now = _now()
    _write_record(run_dir, {"experiment": run_dir.parent.name, "rebuilt": rebuilt, "started_at": now,
                            "attempts": [{"started_at": now, "exit_code": None}]})


def end_rebuilt(run_dir: Path, exit_code: int, verdict: str | None = None) -> None:
    """Record how a rebuilt run's training ended, and the rerun's verdict once it is known."""
    path = run_dir / paths.RUN_RECORD
    record = json.loads(path.read_text())
    record["attempts"][-1].update(exit_code=exit_code, ended_at=_now())
    if verdict is not None:
        record["rebuilt"]["verdict"] = verdict
    _write_record(run_dir, record)


def rebuilt_of(recorded: RecordedRun, kind: str, **extra) -> dict:
    """The ``rebuilt`` entry of a rebuilt run's record: its kind and source (MLflow run id and run directory)."""
    source = recorded.config.get("run_dir")
    return {"kind": kind, "of_mlflow_run_id": recorded.run_id, "of_run_dir": str(source) if source else None,
            **extra}


def _write_record(run_dir: Path, record: dict) -> None:
    makedirs_durably(run_dir)
    write_text_atomic(run_dir / paths.RUN_RECORD, json.dumps(record, indent=2, default=str))


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def training_config(recorded: RecordedRun, run_dir: Path, store: str, manifest: str, uri: str,
                    run_name: str | None = None) -> dict:
    """The recorded config with only resume-safe keys changed: where to write, read and record."""
    config = json.loads(json.dumps(recorded.config))
    config["run_dir"] = str(run_dir)
    config["checkpoint"]["dir"] = paths.checkpoints_dir(run_dir)
    config["data"]["store"], config["data"]["manifest"] = store, manifest
    config["tracking"]["enabled"], config["tracking"]["uri"] = True, uri
    if run_name:
        config["tracking"]["run_name"] = run_name
    config["parallel"]["nproc_per_node"], config["parallel"]["nnodes"] = recorded.world_size, 1
    config["trainer"]["progress_bar"] = False
    return config


def launch(config: dict, run_dir: Path, overrides: list[str] = ()) -> int:
    """Train this config through the launcher (preflight, torchrun, signal forwarding); returns its exit code."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dir = run_dir / RECORDED_CONFIG_DIR
    config_dir.mkdir(exist_ok=True)
    primary = {**config, "hydra": {"run": {"dir": str(run_dir)}, "output_subdir": "hydra", "job": {"chdir": False}}}
    (config_dir / "config.yaml").write_text(yaml.safe_dump(primary, sort_keys=False))
    return launch_training(compose_start(list(overrides), config_dir.resolve()))


def new_run_id(run_dir: Path) -> str:
    """The MLflow run id the rebuilt run's first start created."""
    state = Spool(run_dir).state()
    if not state["run_id"]:
        raise RerunError(f"the new run's records are still spooled in {run_dir}/tracking (tracking unreachable?); "
                         f"run `worldpipe tracking sync {run_dir}` and compare with `worldpipe compare`")
    return state["run_id"]


def default_run_dir(recorded: RecordedRun, kind: str) -> Path:
    """<runs>/<experiment>/<kind>-<run id prefix>-<time> (conf/paths): a new directory for a rebuilt run, beside
    the experiment's config-addressed runs (never one of their hashes, so no pipeline job trains into it)."""
    name = recorded.config.get("experiment_name", "run")
    return Path(paths.layout()["runs"]) / name / f"{kind}-{recorded.run_id[:8]}-{time.strftime('%Y%m%d-%H%M%S')}"

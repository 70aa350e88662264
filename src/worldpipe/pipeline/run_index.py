"""The runs of each experiment on disk: the pipeline's run record, the `latest` link, and each run's status.

The training rule calls `begin` before it launches training and `end` after, so a run directory says what it
is (its overrides, resolved config and dataset), when it was first started, and how each attempt ended.
Checkpoints, the completion record and the tracking spool say how far it got.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from worldpipe.checkpoint.layout import LATEST_NAME, latest_identity, parse_step_dir
from worldpipe.config import paths
from worldpipe.config.identity import config_hash, flatten, identity_config, to_container
from worldpipe.core import numerics
from worldpipe.core.atomic import makedirs_durably, remove_atomic, symlink_atomic, write_text_atomic
from worldpipe.core.errors import UsageError
from worldpipe.launch.run_lock import RunLock
from worldpipe.pipeline.plan import compose, run_hash
from worldpipe.tracking.spool import Spool
from worldpipe.trainer.preemption import EXIT_PREEMPTED

# What the pipeline derives from a finished attempt inside its run directory (the completion record first; the
# outputs of evaluate.smk's evaluate_model and plot_loss_curve after it).
DERIVED_RESULTS = (paths.COMPLETION_RECORD, paths.EVAL_DIR, paths.CONTROL_DIR, paths.LOSS_CURVE)


class RunDirMismatch(UsageError, ValueError):
    """A run directory whose name is not the hash of the config about to train in it."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def point_latest(run_dir: Path) -> None:
    """Make `<experiment>/latest` a relative symlink to `run_dir`, replacing the old link atomically."""
    symlink_atomic(run_dir.parent / paths.LATEST_LINK, run_dir.name)


def begin(run_dir: str | os.PathLike, dataset_spec_hash: str, overrides: Sequence[str],
          cfg: DictConfig | None = None) -> dict[str, Any]:
    """Record an attempt at a run before training starts; refuse a directory that is not the config's hash.

    The config is the one the training gets (``cfg``, composed from ``overrides`` when not given), so a
    directory named by one hash never holds a run of another (e.g. if conf/ changed between Snakemake's parse and
    this job). A directory whose run lock a live process holds is refused (RunLocked names it); otherwise the
    results of the previous attempt stop being current (:func:`invalidate_results`).
    """
    run_dir = Path(run_dir)
    # A training still running here (say, orphaned by a killed Snakemake) is refused by name, before anything
    # is composed or changed.
    RunLock(run_dir).ensure_free()
    cfg = cfg if cfg is not None else compose(overrides)
    cfg_hash = config_hash(cfg)
    expected = paths.short(run_hash(cfg_hash, dataset_spec_hash))
    if run_dir.name != expected:
        raise RunDirMismatch(f"run directory {run_dir} is not this config's run: its hash is {expected} "
                             "(conf/ or the overrides changed since the DAG was built; run snakemake again)")
    record = _read_json(run_dir / paths.RUN_RECORD) or {
        "experiment": run_dir.parent.name, "run_hash": expected, "config_hash": cfg_hash,
        "dataset_spec_hash": dataset_spec_hash, "overrides": list(overrides),
        "config": flatten(to_container(cfg)), "started_at": _now(), "attempts": [],
    }
    record["attempts"].append({"started_at": _now(), "exit_code": None})
    # Durably: the run's record, `latest` and every checkpoint below it are only as durable as these names.
    makedirs_durably(run_dir)
    invalidate_results(run_dir)
    write_text_atomic(run_dir / paths.RUN_RECORD, json.dumps(record, indent=2, default=str))
    point_latest(run_dir)
    return record


def end(run_dir: str | os.PathLike, exit_code: int) -> None:
    """Record how the newest attempt at a run ended."""
    path = Path(run_dir) / paths.RUN_RECORD
    record = _read_json(path)
    if record is None or not record.get("attempts"):
        raise RunDirMismatch(f"{path}: no run record with a started attempt (`worldpipe runs begin` records one)")
    record["attempts"][-1].update(exit_code=exit_code, ended_at=_now())
    write_text_atomic(path, json.dumps(record, indent=2, default=str))


def invalidate_results(run_dir: Path) -> list[str]:
    """Remove the completion record and what was derived from it (evaluations, closed-loop evaluations, loss
    curve); returns their names.

    A new attempt changes where the run ends, so these describe a state that is no longer the run's. Snakemake
    decides "done" from these files alone: left in place, an interrupted attempt (a killed Snakemake, its
    completion record already removed) would have a plain rerun report "Nothing to be done" over the old
    results. Removed completion record first, each atomically (a directory is renamed aside, then deleted).
    """
    removed = []
    for name in DERIVED_RESULTS:
        if remove_atomic(run_dir / name, run_dir / f".{name}.stale-{uuid.uuid4().hex[:12]}"):
            removed.append(name)
    return removed


@dataclass
class RunInfo:
    """One run directory as `worldpipe runs list` shows it."""
    path: Path
    record: dict[str, Any]
    status: str
    mlflow_run_id: str | None
    is_latest: bool


def checkpoint_step(run_dir: Path) -> int | None:
    """Step of the newest published checkpoint in the run's local checkpoint directory, if any."""
    pointer = Path(paths.checkpoints_dir(run_dir)) / LATEST_NAME
    try:
        return parse_step_dir(pointer.read_text().strip())
    except OSError:
        return None


def run_status(run_dir: Path, record: dict[str, Any]) -> str:
    """finished, running, interrupted (killed or preempted) or failed, with the step it got to."""
    done = _read_json(run_dir / paths.COMPLETION_RECORD)
    if done is not None:
        return f"finished at step {done.get('final_step')}"
    step = checkpoint_step(run_dir)
    where = f"at step {step}" if step is not None else "before its first checkpoint"
    if Spool(run_dir).writer_alive():
        return f"running, checkpointed {where}"
    attempts = record.get("attempts") or [{}]
    code = attempts[-1].get("exit_code")
    if code is None or code == EXIT_PREEMPTED:
        return f"interrupted {where}" + (" (preempted)" if code == EXIT_PREEMPTED else "")
    return f"failed {where} (exit code {code})"


def numerics_lines(run_dir: Path) -> list[str]:
    """The numerics environment the run's newest checkpoint was written on, and each resume onto another one."""
    identity = latest_identity(paths.checkpoints_dir(run_dir))
    env = identity.get(numerics.IDENTITY_KEY)
    if not env:
        return []
    lines = [f"numerics {numerics.summary(env)} ({env.get('cpu.model', '?')}, {env.get('blas', '?')})"]
    for change in identity.get(numerics.CHANGES_KEY) or []:
        fields = ", ".join(line.split(":", 1)[0] for line in change["fields"])
        lines.append(f"resumed at step {change['step']} on a different numerics environment: {fields}")
    return lines


def mlflow_run_id(run_dir: Path) -> str | None:
    """The run's MLflow run id: from its completion record, else from its tracking spool."""
    done = _read_json(run_dir / paths.COMPLETION_RECORD) or {}
    return done.get("mlflow_run_id") or Spool(run_dir).state().get("run_id")


def experiment_runs(experiment_dir: Path) -> list[RunInfo]:
    """Every run of one experiment, oldest first (by the time the pipeline first started it)."""
    latest = experiment_dir / paths.LATEST_LINK
    target = os.readlink(latest) if latest.is_symlink() else None
    runs = []
    for child in sorted(experiment_dir.iterdir()):
        if child.is_symlink() or not child.is_dir() or child.name.startswith("."):
            continue
        record = _read_json(child / paths.RUN_RECORD)
        if record is None:
            continue
        runs.append(RunInfo(child, record, run_status(child, record), mlflow_run_id(child), child.name == target))
    return sorted(runs, key=lambda run: (run.record.get("started_at", ""), run.path.name))


def rebuilt_line(record: dict[str, Any], with_verdict: bool = True) -> str | None:
    """What a rebuilt run (`worldpipe rerun` / `resume`) rebuilt, and the rerun's verdict; None for any other run."""
    rebuilt = record.get("rebuilt")
    if not rebuilt:
        return None
    source = Path(rebuilt["of_run_dir"]).name if rebuilt.get("of_run_dir") else "a run"
    kind = "rerun" if rebuilt.get("kind") == "rerun" else f"resumed at step {rebuilt.get('at_step')}"
    if not with_verdict:
        return f"{kind} of {source}"
    verdict = f": {rebuilt['verdict']}" if rebuilt.get("verdict") else ""
    return f"{kind} of {source} (mlflow {rebuilt.get('of_mlflow_run_id')}){verdict}"


def control_line(run_dir: Path) -> str | None:
    """The newest closed-loop evaluation of a run in one line: the planner's return with its 95% CI, the score
    and where the record is; None where the run has none."""
    records = sorted((run_dir / paths.CONTROL_DIR).glob("*/control.json"), key=lambda p: p.stat().st_mtime)
    record = _read_json(records[-1]) if records else None
    if not record:
        return None
    planner = record["contenders"]["planner"]
    low, high = planner["ci95"]
    score = record.get("score")
    scored = "" if score is None else f", score {score:.3f}"
    return (f"control: return {planner['mean']:.1f} [95% CI {low:.1f}, {high:.1f}] over {planner['episodes']} "
            f"episodes{scored} ({paths.CONTROL_DIR}/{records[-1].parent.name})")


def config_changes(previous: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """`key: old -> new` for the identity keys (and the dataset) that differ from the previous run."""
    if previous is None:
        return []
    before = identity_config(previous.get("config", {})) | {"dataset": previous.get("dataset_spec_hash")}
    after = identity_config(current.get("config", {})) | {"dataset": current.get("dataset_spec_hash")}
    return [f"{key}: {before.get(key, '<absent>')!r} -> {after.get(key, '<absent>')!r}"
            for key in sorted(set(before) | set(after)) if before.get(key, "<absent>") != after.get(key, "<absent>")]


# The end of a progress record read for its last line: lines are ~150 bytes, so a few KiB always holds one.
_PROGRESS_TAIL_BYTES = 4096


def last_progress(run_dir: Path) -> dict[str, Any] | None:
    """The newest complete line of a run directory's progress record (rank 0 appends one at log cadence)."""
    try:
        with open(run_dir / paths.PROGRESS_RECORD, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _PROGRESS_TAIL_BYTES))
            tail = handle.read()
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:  # the first, cut line of the tail (or one a crash cut short)
            continue
        if isinstance(record, dict) and "step" in record:
            return record
    return None


def progress_run_dirs(roots: Sequence[Path]) -> list[Path]:
    """Run directories two levels below each root (<experiment>/<hash>, <sweep>/<point>) with a progress record."""
    found = []
    for root in roots:
        for record in sorted(root.glob(f"*/*/{paths.PROGRESS_RECORD}")):
            if not record.parent.is_symlink():  # `latest` names a run listed under its own name
                found.append(record.parent)
    return found

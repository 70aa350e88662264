"""`worldpipe resume RUN_ID --step N`: continue a recorded run from one of its checkpoints, in a new run."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import sys
from pathlib import Path

from worldpipe.checkpoint import CheckpointManager, layout
from worldpipe.config import paths
from worldpipe.core.atomic import fsync_tree, publish_dir
from worldpipe.core.locations import local_path, open_filesystem
from worldpipe.reproduce.dataset import locate_dataset, resolve_recorded_path
from worldpipe.reproduce.drift import RerunError, RerunTrainingFailed, check_code
from worldpipe.reproduce.launching import (
    default_run_dir,
    end_rebuilt,
    launch,
    new_run_id,
    prepare_run_dir,
    rebuilt_of,
    training_config,
)
from worldpipe.reproduce.rerun import EXIT_ERROR
from worldpipe.tracking.connection import client_for, resolve_tracking_uri
from worldpipe.tracking.history import RecordError, load_recorded_run, read_artifact
from worldpipe.tracking.records import CHECKPOINT_ARTIFACT_DIR


def recorded_steps(client, run_id: str) -> list[int]:
    """Steps whose checkpoint records (manifest, digest, sampler, RNG) the run holds."""
    steps = []
    for info in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT_DIR):
        name = info.path.rsplit("/", 1)[-1]
        step = layout.parse_step_dir(name)
        if info.is_dir and step is not None:
            steps.append(step)
    return sorted(steps)


def _copy_checkpoint(source: str, target_root: Path, step: int) -> None:
    """Copy a published step into a new checkpoint root: partial directory, fsync, rename, fsync."""
    target_root.mkdir(parents=True, exist_ok=True)
    partial = target_root / layout.temp_name(step, "partial", secrets.token_hex(6))
    local = local_path(source)
    if local is None:
        fs, path = open_filesystem(source)
        fs.get(path.rstrip("/") + "/", str(partial), recursive=True)
    else:
        shutil.copytree(local, partial)
    fsync_tree(partial)
    publish_dir(partial, target_root / layout.step_dir_name(step),
                target_root / layout.temp_name(step, "replaced", secrets.token_hex(6)))


def resume(run_id: str, step: int, uri: str | None = None, allow_code_drift: bool = False,
           run_dir: str | None = None, data_dir: str | None = None, overrides: list[str] = ()) -> int:
    """Continue run `run_id` from its recorded checkpoint `step` into a new run directory and MLflow run."""
    uri = resolve_tracking_uri(uri)
    client = client_for(uri)
    try:
        recorded = load_recorded_run(client, run_id)
        steps = recorded_steps(client, run_id)
        if step not in steps:
            raise RerunError(f"run {run_id} recorded no checkpoint at step {step}; recorded steps: {steps}")
        base = f"{CHECKPOINT_ARTIFACT_DIR}/{layout.step_dir_name(step)}"
        digest = json.loads(read_artifact(client, run_id, f"{base}/digest.json"))
        checkpoint_dir = resolve_recorded_path(str(digest["checkpoint_dir"]).rstrip("/"), recorded.tags.get("worldpipe.cwd"))
        source = f"{checkpoint_dir}/{layout.step_dir_name(step)}"
        found = layout.read_manifest_bytes(checkpoint_dir, step)
        if found is None:
            raise RerunError(f"checkpoint step {step} is no longer at {source} (retention keeps checkpoint.keep_last "
                             "and keep_every steps); recorded steps are " + str(steps))
        if hashlib.sha256(found).hexdigest() != digest["manifest_sha256"]:
            raise RerunError(f"the checkpoint at {source} is not the one recorded for step {step} "
                             "(its MANIFEST.json differs from the run's artifact)")
        drift = check_code(recorded, allow_code_drift)
        store, manifest, how = locate_dataset(recorded, data_dir)
        print(f"dataset {recorded.identity.get('dataset_hash', '')[:16]}… ({how}): {store}", flush=True)
        target = (Path(run_dir) if run_dir else default_run_dir(recorded, f"resume{step}")).resolve()
        tags = {"worldpipe.resumed_from": run_id, "worldpipe.resumed_at_step": str(step)}
        if drift:
            tags["worldpipe.code_drift"] = drift[:5000]
        prepare_run_dir(target, tags, rebuilt_of(recorded, "resume", at_step=step), copy_history=(run_id, step))
        _copy_checkpoint(source, Path(paths.checkpoints_dir(target)), step)
        problems = CheckpointManager(paths.checkpoints_dir(target)).verify(step, full=True)
        if problems:
            raise RerunError(f"copied checkpoint step {step} does not verify: {problems}")
        name = f"{recorded.run.info.run_name or 'run'} (resumed from {run_id[:8]} at step {step})"
        code = launch(training_config(recorded, target, store, manifest, uri, name), target, list(overrides))
        end_rebuilt(target, code)
        if code != 0:
            raise RerunTrainingFailed(f"resumed training exited with {code} (run dir {target})")
        new_run = new_run_id(target)
    except (RerunError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_ERROR)
    print(f"resumed {run_id} from step {step}: new run {new_run} in {target}")
    return 0

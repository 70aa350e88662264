"""`worldpipe rerun` and `worldpipe resume`: rebuild a training run from its MLflow records alone.

From the records: the resolved config (config.yaml, checked against every param), the world size, the code
version and package versions (identity.json and tags), the dataset hash and generation spec
(dataset/manifest.json), and the checkpoints' manifests and digests (checkpoints/step-NNNNNN/).

A rerun trains the recorded config from scratch into a new run directory and a new MLflow run tagged
``worldpipe.rerun_of``, then compares metric histories (clock-measured metrics excluded) and the final
checkpoint digests: ``bit-identical`` (exit 0) or the first differing step and metric (exit 1). Anything that
prevents a faithful rerun (code drift without ``--allow-code-drift``, a dataset that cannot be found or
regenerated with the recorded hash, a failed training) exits 2.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from worldpipe import identity as ident
from worldpipe.atomic import fsync_dir
from worldpipe.tracking.history import (
    RecordedRun,
    RecordError,
    client_for,
    first_difference,
    histories,
    load_recorded_run,
    read_artifact,
)
from worldpipe.tracking.recorder import resolve_tracking_uri
from worldpipe.tracking.records import (
    CHECKPOINT_ARTIFACT_DIR,
    TIMING_METRICS,
    read_checkpoint_manifest,
    step_dir,
)
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.rerun")

EXIT_IDENTICAL, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


class RerunError(RuntimeError):
    """The run cannot be rebuilt faithfully; the message says why and what to do."""


# ---------------------------------------------------------------- code and environment
def code_drift(recorded: RecordedRun) -> list[str]:
    """Differences between the recorded code/environment and this checkout (empty: same code)."""
    rec_code = recorded.identity.get("code_version", {})
    cur_code = ident.code_version()
    problems = []
    if rec_code.get("git_sha") != cur_code.get("git_sha"):
        problems.append(f"git SHA: recorded {rec_code.get('git_sha')}, checkout {cur_code.get('git_sha')}")
    rec_diff = recorded.tags.get("worldpipe.git_diff_sha256") if rec_code.get("git_dirty") else None
    cur_diff = hashlib.sha256(ident.git_diff().encode()).hexdigest() if cur_code.get("git_dirty") else None
    if rec_diff != cur_diff:
        problems.append(f"uncommitted changes: recorded {_short(rec_diff) or 'none'}, checkout {_short(cur_diff) or 'none'}"
                        " (the recorded diff is the artifact code/git_diff.patch)")
    rec_versions, cur_versions = recorded.identity.get("versions", {}), ident.package_versions()
    for name in sorted(set(rec_versions) | set(cur_versions)):
        if rec_versions.get(name) != cur_versions.get(name):
            problems.append(f"{name}: recorded {rec_versions.get(name)}, installed {cur_versions.get(name)}")
    if recorded.identity.get("lock_hash") != ident.lock_hash():
        problems.append(f"requirements.lock: recorded {_short(recorded.identity.get('lock_hash'))}, "
                        f"checkout {_short(ident.lock_hash())}")
    return problems


def _short(text: str | None) -> str | None:
    return text[:12] if text else text


def check_code(recorded: RecordedRun, allow_drift: bool) -> str | None:
    """Raise RerunError on drift unless allowed; returns the drift description to record (None: no drift)."""
    problems = code_drift(recorded)
    if not problems:
        return None
    text = "; ".join(problems)
    if not allow_drift:
        sha = recorded.identity.get("code_version", {}).get("git_sha")
        raise RerunError(
            f"code differs from the one run {recorded.run_id} was trained with:\n  " + "\n  ".join(problems)
            + f"\ncheck out {sha} (and apply its code/git_diff.patch artifact, install its "
            "environment/requirements.lock), or pass --allow-code-drift to proceed and record the drift")
    log.warning("proceeding despite code drift (recorded on the new run): %s", text)
    return text


# ---------------------------------------------------------------- dataset
def _resolve(path: str, cwd: str | None) -> str:
    if "://" in path or Path(path).is_absolute() or not cwd:
        return path
    return str(Path(cwd) / path)


def _dataset_ok(store: str, manifest_path: str, expected: str) -> bool:
    from worldpipe.data.manifest import load_manifest, verify_dataset

    try:
        if load_manifest(manifest_path)["dataset_hash"] != expected:
            return False
        return all(status["status"] == "ok" for status in verify_dataset(store, manifest_path))
    except Exception as err:  # noqa: BLE001 - missing or unreadable: not this dataset
        log.info("dataset at %s not usable: %s", store, err)
        return False


def _cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "worldpipe.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RerunError(f"`worldpipe {' '.join(args[:2])}` failed:\n{proc.stderr[-2000:]}")


def regenerate_dataset(spec: dict, target: Path) -> tuple[str, str]:
    """init + write every shard + seal through the CLI (exactly what the Snakemake rules run)."""
    store, manifest = target / "store.zarr", target / "manifest.json"
    if store.exists():
        shutil.rmtree(store)
    manifest.unlink(missing_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    text = json.dumps(spec, sort_keys=True)
    shards = -(-int(spec["episodes"]) // int(spec["episodes_per_shard"]))
    _cli("data", "init", "--spec", text, "--store", str(store))
    _cli("data", "write", "--spec", text, "--store", str(store), "--shards", f"0:{shards}", "--no-progress")
    _cli("data", "seal", "--store", str(store), "--manifest", str(manifest))
    return str(store), str(manifest)


def locate_dataset(recorded: RecordedRun, data_dir: str | None = None) -> tuple[str, str, str]:
    """(store, manifest, how): the recorded location if it still holds the recorded hash, else a regeneration."""
    expected = recorded.identity.get("dataset_hash") or recorded.tags.get("worldpipe.dataset_hash")
    cwd = recorded.tags.get("worldpipe.cwd")
    data = recorded.config.get("data", {})
    store, manifest = _resolve(str(data.get("store")), cwd), _resolve(str(data.get("manifest")), cwd)
    if _dataset_ok(store, manifest, expected):
        return store, manifest, "recorded location"
    target = Path(data_dir) if data_dir else Path("results/data") / f"rerun-{expected[:16]}"
    if _dataset_ok(str(target / "store.zarr"), str(target / "manifest.json"), expected):
        return str(target / "store.zarr"), str(target / "manifest.json"), "earlier regeneration"
    spec = (recorded.manifest or {}).get("spec")
    if not spec:
        raise RerunError(f"dataset {expected[:16]}… is not at {store} and the run's dataset/manifest.json artifact "
                         "holds no generation spec; pass --data-dir with the original dataset")
    log.info("regenerating dataset %s… from its recorded spec into %s", expected[:16], target)
    store, manifest = regenerate_dataset(spec, target)
    from worldpipe.data.manifest import load_manifest

    got = load_manifest(manifest)["dataset_hash"]
    if got != expected:
        raise RerunError(f"the regenerated dataset has hash {got[:16]}…, the run was trained on {expected[:16]}…: "
                         "data generation is not reproducible here (code or package drift?)")
    return store, manifest, "regenerated"


# ---------------------------------------------------------------- launching
def prepare_run_dir(run_dir: Path, tags: dict[str, str], copy_history: tuple[str, int] | None = None) -> None:
    """Tell the run directory's recorder to create a new MLflow run (with these tags) at its first start."""
    spool = Spool(run_dir)
    if spool.journal.exists():
        raise RerunError(f"{run_dir} already holds a recorded run; pick a new --run-dir")
    with spool.locked():
        state = spool.state()
        state["new_run"] = {"tags": tags}
        if copy_history:
            state["new_run"].update(copy_history_from=copy_history[0], through_step=int(copy_history[1]))
        spool.save_state(state)


def training_config(recorded: RecordedRun, run_dir: Path, store: str, manifest: str, uri: str,
                    run_name: str | None = None) -> dict:
    """The recorded config with only resume-safe keys changed: where to write, read and record."""
    config = json.loads(json.dumps(recorded.config))
    config["run_dir"] = str(run_dir)
    config["checkpoint"]["dir"] = str(run_dir / "checkpoints")
    config["data"]["store"], config["data"]["manifest"] = store, manifest
    config["tracking"]["enabled"], config["tracking"]["uri"] = True, uri
    if run_name:
        config["tracking"]["run_name"] = run_name
    config["parallel"]["nproc_per_node"], config["parallel"]["nnodes"] = recorded.world_size, 1
    config["trainer"]["progress_bar"] = False
    return config


def launch(config: dict, run_dir: Path, overrides: list[str] = ()) -> int:
    """torchrun with this config as Hydra's primary config (not conf/: the recorded values win over defaults)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dir = run_dir / "rerun_config"
    config_dir.mkdir(exist_ok=True)
    primary = {**config, "hydra": {"run": {"dir": str(run_dir)}, "output_subdir": "hydra", "job": {"chdir": False}}}
    (config_dir / "config.yaml").write_text(yaml.safe_dump(primary, sort_keys=False))
    nproc = int(config["parallel"]["nproc_per_node"])
    from worldpipe.launch import torchrun_argv

    cmd = torchrun_argv(nproc, 1, [f"--config-path={config_dir.resolve()}", "--config-name=config", *overrides,
                                   f"hydra.run.dir={run_dir}"])
    log.info("training: %s", " ".join(cmd))
    return subprocess.run(cmd).returncode


def _new_run_id(run_dir: Path) -> str:
    state = Spool(run_dir).state()
    if not state["run_id"]:
        raise RerunError(f"the new run's records are still spooled in {run_dir}/tracking (tracking unreachable?); "
                         f"run `worldpipe tracking sync {run_dir}` and compare with `worldpipe compare`")
    return state["run_id"]


def _default_run_dir(recorded: RecordedRun, kind: str) -> Path:
    name = recorded.config.get("experiment_name", "run")
    return Path("results/runs") / f"{name}-{kind}-{recorded.run_id[:8]}-{time.strftime('%Y%m%d-%H%M%S')}"


# ---------------------------------------------------------------- rerun
@dataclass
class RerunResult:
    new_run_id: str
    identical: bool
    difference: tuple | None
    digests: tuple[str | None, str | None]
    message: str


def compare_runs(client, original: str, rerun: str) -> RerunResult:
    """Metric histories (clock metrics excluded) and final checkpoint digests of two runs."""
    a, b = histories(client, original), histories(client, rerun)
    diff = first_difference(a, b, TIMING_METRICS)
    da = client.get_run(original).data.tags.get("worldpipe.checkpoint.digest")
    db = client.get_run(rerun).data.tags.get("worldpipe.checkpoint.digest")
    compared = sorted(set(a) - set(TIMING_METRICS))
    points = sum(len(a[k]) for k in compared)
    if diff is not None:
        step, key, x, y = diff
        message = f"differs: first at step {step}, metric {key}: original {x!r}, rerun {y!r}"
    elif da is None or da != db:
        message = f"differs: final checkpoint digest: original {da}, rerun {db} (metric histories are identical)"
    else:
        message = (f"bit-identical ({len(compared)} metrics, {points} values, final checkpoint digest "
                   f"{da[:16]}…)")
    return RerunResult(rerun, diff is None and da is not None and da == db, diff, (da, db), message)


def rerun(run_id: str, uri: str | None = None, allow_code_drift: bool = False, run_dir: str | None = None,
          data_dir: str | None = None) -> int:
    """Rebuild and retrain run `run_id`, compare, print the verdict; returns the exit code."""
    uri = resolve_tracking_uri(uri)
    client = client_for(uri)
    try:
        recorded = load_recorded_run(client, run_id)
        drift = check_code(recorded, allow_code_drift)
        store, manifest, how = locate_dataset(recorded, data_dir)
        print(f"dataset {recorded.identity.get('dataset_hash', '')[:16]}… ({how}): {store}", flush=True)
        target = Path(run_dir) if run_dir else _default_run_dir(recorded, "rerun")
        tags = {"worldpipe.rerun_of": run_id}
        if drift:
            tags["worldpipe.code_drift"] = drift[:5000]
        prepare_run_dir(target, tags)
        name = f"{recorded.run.info.run_name or 'run'} (rerun of {run_id[:8]})"
        config = training_config(recorded, target.resolve(), store, manifest, uri, name)
        code = launch(config, target)
        if code != 0:
            raise RerunError(f"rerun training exited with {code} (run dir {target})")
        result = compare_runs(client, run_id, _new_run_id(target))
    except (RerunError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    client.set_tag(result.new_run_id, "worldpipe.rerun_result", result.message[:5000])
    if recorded.run.info.status != "FINISHED":
        print(f"note: the original run's status is {recorded.run.info.status}", file=sys.stderr)
    print(f"rerun of {run_id}: new run {result.new_run_id} in {target}")
    print(result.message)
    return EXIT_IDENTICAL if result.identical else EXIT_DIFFERENT


# ---------------------------------------------------------------- resume
def recorded_steps(client, run_id: str) -> list[int]:
    """Steps whose checkpoint records (manifest, digest, sampler, RNG) the run holds."""
    steps = []
    for info in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT_DIR):
        name = info.path.rsplit("/", 1)[-1]
        if info.is_dir and name.startswith("step-") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return sorted(steps)


def _copy_checkpoint(source: str, target_root: Path, step: int) -> None:
    """Copy a published step into a new checkpoint root: partial directory, fsync, rename, fsync."""
    target_root.mkdir(parents=True, exist_ok=True)
    partial = target_root / f".{step_dir(step)}.partial-{uuid.uuid4().hex[:8]}"
    if "://" in source:
        import fsspec

        fs, path = fsspec.core.url_to_fs(source)
        fs.get(path.rstrip("/") + "/", str(partial), recursive=True)
    else:
        shutil.copytree(source, partial)
    for path in sorted(partial.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        else:
            fsync_dir(path)
    fsync_dir(partial)
    os.rename(partial, target_root / step_dir(step))
    fsync_dir(target_root)


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
        base = f"{CHECKPOINT_ARTIFACT_DIR}/{step_dir(step)}"
        digest = json.loads(read_artifact(client, run_id, f"{base}/digest.json"))
        checkpoint_dir = _resolve(str(digest["checkpoint_dir"]).rstrip("/"), recorded.tags.get("worldpipe.cwd"))
        source = f"{checkpoint_dir}/{step_dir(step)}"
        found = read_checkpoint_manifest(checkpoint_dir, step)
        if found is None:
            raise RerunError(f"checkpoint step {step} is no longer at {source} (retention keeps checkpoint.keep_last "
                             "and keep_every steps); recorded steps are " + str(steps))
        if hashlib.sha256(found).hexdigest() != digest["manifest_sha256"]:
            raise RerunError(f"the checkpoint at {source} is not the one recorded for step {step} "
                             "(its MANIFEST.json differs from the run's artifact)")
        drift = check_code(recorded, allow_code_drift)
        store, manifest, how = locate_dataset(recorded, data_dir)
        print(f"dataset {recorded.identity.get('dataset_hash', '')[:16]}… ({how}): {store}", flush=True)
        target = (Path(run_dir) if run_dir else _default_run_dir(recorded, f"resume{step}")).resolve()
        tags = {"worldpipe.resumed_from": run_id, "worldpipe.resumed_at_step": str(step)}
        if drift:
            tags["worldpipe.code_drift"] = drift[:5000]
        prepare_run_dir(target, tags, copy_history=(run_id, step))
        _copy_checkpoint(source, target / "checkpoints", step)
        from worldpipe.checkpoint import CheckpointManager

        problems = CheckpointManager(str(target / "checkpoints")).verify(step, full=True)
        if problems:
            raise RerunError(f"copied checkpoint step {step} does not verify: {problems}")
        name = f"{recorded.run.info.run_name or 'run'} (resumed from {run_id[:8]} at step {step})"
        code = launch(training_config(recorded, target, store, manifest, uri, name), target, list(overrides))
        if code != 0:
            raise RerunError(f"resumed training exited with {code} (run dir {target})")
        new_run = _new_run_id(target)
    except (RerunError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(f"resumed {run_id} from step {step}: new run {new_run} in {target}")
    return 0

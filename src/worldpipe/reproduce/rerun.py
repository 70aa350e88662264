"""`worldpipe rerun RUN_ID`: retrain a recorded run from its MLflow records alone and compare, bit for bit.

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

import sys
from dataclasses import dataclass
from pathlib import Path

from worldpipe.reproduce.dataset import locate_dataset
from worldpipe.reproduce.drift import RerunError, check_code
from worldpipe.reproduce.launching import (
    default_run_dir,
    launch,
    new_run_id,
    prepare_run_dir,
    training_config,
)
from worldpipe.tracking.history import RecordError, client_for, first_difference, histories, load_recorded_run
from worldpipe.tracking.recorder import resolve_tracking_uri
from worldpipe.tracking.records import TIMING_METRICS

EXIT_IDENTICAL, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


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
        target = Path(run_dir) if run_dir else default_run_dir(recorded, "rerun")
        tags = {"worldpipe.rerun_of": run_id}
        if drift:
            tags["worldpipe.code_drift"] = drift[:5000]
        prepare_run_dir(target, tags)
        name = f"{recorded.run.info.run_name or 'run'} (rerun of {run_id[:8]})"
        config = training_config(recorded, target.resolve(), store, manifest, uri, name)
        code = launch(config, target)
        if code != 0:
            raise RerunError(f"rerun training exited with {code} (run dir {target})")
        result = compare_runs(client, run_id, new_run_id(target))
    except (RerunError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    client.set_tag(result.new_run_id, "worldpipe.rerun_result", result.message[:5000])
    if recorded.run.info.status != "FINISHED":
        print(f"note: the original run's status is {recorded.run.info.status}", file=sys.stderr)
    print(f"rerun of {run_id}: new run {result.new_run_id} in {target}")
    print(result.message)
    return EXIT_IDENTICAL if result.identical else EXIT_DIFFERENT

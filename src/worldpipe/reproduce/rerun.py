"""`worldpipe rerun RUN_ID`: retrain a recorded run from its MLflow records alone and compare, bit for bit.

From the records: the resolved config (config.yaml, checked against every param), the world size, the code
version and package versions (identity.json and tags), the dataset hash and generation spec
(dataset/manifest.json), and the checkpoints' manifests and digests (checkpoints/step-NNNNNN/).

A rerun trains the recorded config from scratch into a new run directory and a new MLflow run tagged
``worldpipe.rerun_of``, then compares metric histories (clock-measured metrics excluded) and the final
checkpoint digests: ``bit-identical`` (exit 0) or the first differing step and metric (exit 1). Anything that
prevents a faithful rerun (code drift without ``--allow-code-drift``, a dataset that cannot be found or
regenerated with the recorded hash) exits 2; a retraining that fails exits 1, as a failed training does.

Bits depend on the numerics environment too (CPU type, MKL code path, ...: :mod:`worldpipe.core.numerics`). Before
training, the rerun names every field in which this machine differs from the recorded one. Then a bitwise match
is not to be expected, and a difference is judged within a stated tolerance instead: the largest relative
difference of any metric value at any step (``--rtol``), and, where the original's final checkpoint is still
on disk, the open-loop prediction error of both final models over repeat-last on the same episodes (``--ratio-tol``):
``equivalent on a different numerics environment`` (exit 3) or ``differs beyond tolerance`` (exit 1).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from worldpipe.config import paths
from worldpipe.core import numerics
from worldpipe.core.errors import EXIT_EQUIVALENT, EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from worldpipe.core.locations import local_path
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
from worldpipe.tracking.connection import client_for, resolve_tracking_uri
from worldpipe.tracking.history import (
    RecordError,
    first_difference,
    histories,
    largest_relative_difference,
    load_recorded_run,
)
from worldpipe.tracking.records import TIMING_METRICS, numerics_from_tags

# The CLI's exit statuses (worldpipe.core.errors), by what a rerun concludes.
EXIT_IDENTICAL, EXIT_DIFFERENT, EXIT_ERROR = EXIT_OK, EXIT_FAILURE, EXIT_USAGE
# Segments of the open-loop comparison of both final models (the pipeline's evaluation defaults).
EQUIVALENCE_CONTEXT, EQUIVALENCE_HORIZON = 4, 8


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


@dataclass
class Tolerance:
    """How far a rerun on another numerics environment may land from the original and still be equivalent."""

    rtol: float = numerics.DEFAULT_RTOL            # largest relative difference of any metric value at any step
    ratio_tol: float = numerics.DEFAULT_RATIO_TOL  # relative difference of the final models' open-loop error ratios


def judge_equivalence(client, original: str, rerun_id: str, checkpoint_dirs: tuple[str | None, str],
                      data: tuple[str, str], tolerance: Tolerance) -> tuple[bool, str]:
    """(equivalent?, the reasons) for two runs trained on different numerics environments."""
    worst, step, key = largest_relative_difference(histories(client, original), histories(client, rerun_id))
    ok = worst <= tolerance.rtol
    parts = [f"largest relative metric difference {worst:.3g} ({key} at step {step})"
             f" {'<=' if ok else '>'} rtol {tolerance.rtol:g}" if key else "metric histories identical"]
    original_dir, rerun_dir = checkpoint_dirs
    if original_dir is None or not Path(original_dir).is_dir():
        parts.append("open-loop check skipped: the original's checkpoints are not on this machine")
        return ok, "; ".join(parts)
    # Imported only now: evaluation brings torch (seconds); the verdicts above do without it.
    from worldpipe.evaluate.open_loop import evaluate

    ratios = [evaluate(d, data[0], data[1], EQUIVALENCE_CONTEXT, EQUIVALENCE_HORIZON)["ratio"][-1]
              for d in (original_dir, rerun_dir)]
    spread = abs(ratios[0] - ratios[1]) / max(abs(ratios[0]), 1e-12)
    ratio_ok = spread <= tolerance.ratio_tol
    parts.append(f"open-loop error ratio at horizon {EQUIVALENCE_HORIZON} {ratios[0]:.4g} vs {ratios[1]:.4g}"
                 f" (relative {spread:.3g} {'<=' if ratio_ok else '>'} {tolerance.ratio_tol:g})")
    return ok and ratio_ok, "; ".join(parts)


def environment_differences(client, recorded, rerun_id: str | None = None) -> list[str]:
    """Fields in which this machine (or, given ``rerun_id``, what that run recorded) differs from the original."""
    before = recorded.identity.get(numerics.IDENTITY_KEY) or numerics_from_tags(recorded.tags)
    if rerun_id is None:
        return numerics.differences(before, numerics.expected_environment(recorded.config))
    return numerics.differences(before, numerics_from_tags(client.get_run(rerun_id).data.tags))


def _original_checkpoints(recorded) -> str | None:
    directory = recorded.config.get("checkpoint", {}).get("dir")
    if not directory:
        return None
    return local_path(resolve_recorded_path(str(directory), recorded.tags.get("worldpipe.cwd")))


def rerun(run_id: str, uri: str | None = None, allow_code_drift: bool = False, run_dir: str | None = None,
          data_dir: str | None = None, tolerance: Tolerance | None = None, regenerate_data: bool = False,
          chain: bool = False) -> int:
    """Rebuild and retrain run `run_id`, compare, print the verdict; returns the exit code.

    ``regenerate_data``: build the training data again from its records even where it is on disk (for a collection
    round: played again by the recorded collecting model), and require the recorded dataset hash. ``chain``: where
    a round's collecting run (or the data it trained on) is gone, rebuild it first from its own MLflow records, at
    the address the round names, bit for bit, and so on back to round 0.
    """
    tolerance = tolerance or Tolerance()
    uri = resolve_tracking_uri(uri)
    client = client_for(uri)
    try:
        recorded = load_recorded_run(client, run_id)
        drift = check_code(recorded, allow_code_drift)
        ancestors = (lambda spec, lineage: rebuild_collector(spec, lineage, uri, allow_code_drift)) if chain else None
        store, manifest, how = locate_dataset(recorded, data_dir, regenerate_data, ancestors)
        print(f"dataset {recorded.identity.get('dataset_hash', '')[:16]}… ({how}): {store}", flush=True)
        expected = environment_differences(client, recorded)
        if expected:
            print("numerics environment differs from the original run's (bits may differ; judged within rtol "
                  f"{tolerance.rtol:g}): " + "; ".join(expected), flush=True)
        target = Path(run_dir) if run_dir else default_run_dir(recorded, "rerun")
        tags = {"worldpipe.rerun_of": run_id}
        if drift:
            tags["worldpipe.code_drift"] = drift[:5000]
        prepare_run_dir(target, tags, rebuilt_of(recorded, "rerun"))
        name = f"{recorded.run.info.run_name or 'run'} (rerun of {run_id[:8]})"
        config = training_config(recorded, target.resolve(), store, manifest, uri, name)
        code = launch(config, target)
        end_rebuilt(target, code)
        if code != 0:
            raise RerunTrainingFailed(f"rerun training exited with {code} (run dir {target})")
        result = compare_runs(client, run_id, new_run_id(target))
        code, message = _verdict(client, recorded, result, target, (store, manifest), tolerance)
        end_rebuilt(target, 0, message[:300])
    except (RerunError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_ERROR)
    client.set_tag(result.new_run_id, "worldpipe.rerun_result", message[:5000])
    if recorded.run.info.status != "FINISHED":
        print(f"note: the original run's status is {recorded.run.info.status}", file=sys.stderr)
    print(f"rerun of {run_id}: new run {result.new_run_id} in {target}")
    print(message)
    return code


def rebuild_collector(spec, lineage: dict, uri: str, allow_code_drift: bool) -> None:
    """Put a collection round's collecting run back at its address (``lineage["collector"]["run_dir"]``) when it is
    not there with the recorded digest: rerun from its MLflow record, its own data located (or rebuilt) at the
    address of the round's parent dataset. RerunError unless the rebuilt run is bit-identical."""
    collector = lineage["collector"]
    run_dir = Path(collector["run_dir"])
    done = run_dir / paths.COMPLETION_RECORD
    if done.is_file() and json.loads(done.read_text()).get("digest") == collector["checkpoint_digest"]:
        return
    round_ = lineage["round"]
    if run_dir.exists():
        raise RerunError(f"round {round_}'s collecting run {run_dir} holds another model than the recorded one "
                         f"(digest {collector['checkpoint_digest'][:16]}…); move it aside to rebuild it")
    if not collector.get("mlflow_run_id"):
        raise RerunError(f"round {round_}'s collecting run {run_dir} is gone and was not recorded in MLflow")
    parent = paths.dataset_dir(spec.collector["parent"]["name"], spec.collector["parent"]["spec_hash"])
    print(f"round {round_} was collected by {run_dir}, which is not here: rebuilding it from MLflow run "
          f"{collector['mlflow_run_id']}", flush=True)
    code = rerun(collector["mlflow_run_id"], uri, allow_code_drift, str(run_dir), parent, chain=True)
    if code != EXIT_IDENTICAL:
        raise RerunError(f"the rebuilt collecting run of round {round_} ({run_dir}) is not bit-identical to MLflow "
                         f"run {collector['mlflow_run_id']} (exit {code}): round {round_}'s data cannot be played "
                         "again")


def _verdict(client, recorded, result: RerunResult, target: Path, data: tuple[str, str],
             tolerance: Tolerance) -> tuple[int, str]:
    """Exit code and message: bitwise on the same environment; within tolerance on another."""
    fields = environment_differences(client, recorded, result.new_run_id)
    if not fields:
        return (EXIT_IDENTICAL if result.identical else EXIT_DIFFERENT), result.message
    where = f"on a different numerics environment ({'; '.join(fields)})"
    if result.identical:
        return EXIT_IDENTICAL, f"{result.message}, {where}"
    equivalent, reasons = judge_equivalence(
        client, recorded.run_id, result.new_run_id,
        (_original_checkpoints(recorded), paths.checkpoints_dir(target)), data, tolerance)
    if equivalent:
        return EXIT_EQUIVALENT, f"equivalent {where}: {reasons} (bitwise: {result.message})"
    return EXIT_DIFFERENT, f"differs beyond tolerance {where}: {reasons} (bitwise: {result.message})"

"""The trainer's records: one MLflow run (rank 0), metrics gated on checkpoint durability, completion files.

Glue between the checkpoint package and the tracking package, which know nothing of each other: it implements
the Checkpointer's listener with the run recorder.

The MLflow run starts in the background (store creation and ``start_run`` cost seconds before the first step
otherwise), and no save waits for it: a checkpoint's identity names the run once its start has been acknowledged
(the spool's state), and one written earlier (the first of a short run) names none; a resume from that one
reopens the run the run directory's spool names. The final checkpoint and the completion record do wait for the
start to have been tried, so both name the run (None only while the server is unreachable). The start's
artifacts (config, identity, environment listing: the listing alone takes about half a second) are assembled and
journaled on a helper thread, without the run id; the first checkpoint waits for them, so a kill before it
costs nothing (the rerun from step 0 records them again) and one after it finds them journaled. The segment's
end journals its ``identity.json`` again, naming the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from worldpipe.checkpoint import layout as checkpoint_layout
from worldpipe.config.identity import flatten
from worldpipe.config.paths import COMPLETION_RECORD, PROGRESS_RECORD
from worldpipe.core.atomic import write_text_atomic
from worldpipe.core.locations import recorded_form
from worldpipe.measure.startup import mark
from worldpipe.tracking.datasets import TRAINING, DatasetRecord
from worldpipe.tracking.links import MLFLOW_EXPERIMENT_KEY
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.records import (
    IDENTITY_ARTIFACT,
    checkpoint_artifacts,
    checkpoint_tags,
    json_artifact,
    run_tags,
    start_artifacts,
)
from worldpipe.trainer.preemption import PREEMPTED_RECORD

log = logging.getLogger("worldpipe.tracking")


class _Helper:
    """One call on a daemon thread; ``join`` waits for it and raises what it raised (once)."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self._error: BaseException | None = None
        self._work = work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as err:  # noqa: BLE001 - handed to whoever joins
            self._error = err

    def join(self) -> None:
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


def published_artifacts(step: int, state: Mapping[str, Any], digest: str | None,
                        checkpoint_dir: str) -> dict[str, bytes]:
    """MLflow artifacts of a published checkpoint: its manifest, digest, sampler/progress, every rank's RNG."""
    manifest = checkpoint_layout.read_manifest_bytes(checkpoint_dir, step)
    files = {} if manifest is None else {checkpoint_layout.MANIFEST_NAME: manifest}
    for rank, rng in enumerate(state.get(checkpoint_layout.RNG) or []):
        files[checkpoint_layout.rng_view_file(rank)] = json_artifact(rng)
    digest_record = {"step": step, "state_digest": digest, "checkpoint_dir": str(checkpoint_dir),
                     "manifest_sha256": hashlib.sha256(manifest).hexdigest() if manifest is not None else None}
    train_state = {"progress": state.get(checkpoint_layout.PROGRESS), "sampler": state.get(checkpoint_layout.SAMPLER)}
    return checkpoint_artifacts(checkpoint_layout.step_dir_name(step), digest_record, train_state, files)


def checkpoint_location(cfg: DictConfig) -> str:
    """The checkpoint directory as recorded: an absolute path, or the URL as given."""
    return recorded_form(str(cfg.checkpoint.dir))


class TrainingRecords:
    """What a training run records besides its checkpoints; every call is a no-op off rank 0."""

    def __init__(self, cfg: DictConfig, is_main: bool) -> None:
        self.run_dir = Path(cfg.run_dir)
        self.is_main = is_main
        self.location = checkpoint_location(cfg)
        self.recorder = RunRecorder(cfg.tracking.enabled and is_main, cfg.tracking.uri, cfg.tracking.experiment,
                                    run_dir=self.run_dir, system_metrics_s=cfg.tracking.system_metrics_interval_s,
                                    system_metrics_samples=cfg.tracking.system_metrics_samples_before_logging,
                                    on_opened=lambda: mark("mlflow_run_opened"))
        self._identity: dict[str, Any] | None = None  # the trainer's identity dict: checkpoints record it
        self._start_files: _Helper | None = None  # the start's artifacts, journaled off the critical path
        self._start_identity: dict[str, Any] | None = None  # the identity this start journaled
        self.store = str(cfg.data.store)
        self.run_name = cfg.tracking.run_name
        self._progress_off = False  # set when the progress record could not be written (never retried)

    def open_run(self, identity: dict[str, Any], run_id: str | None, start_step: int) -> str | None:
        """Open the MLflow run, or reopen the one a resumed checkpoint names; the run id on rank 0 if known yet.

        ``identity`` is kept: its ``mlflow_run_id`` is filled in once the background start has created the run.
        """
        self._identity = identity
        return self.recorder.start(run_id, self.run_name, tags=run_tags(identity, start_step),
                                   resume_step=start_step, checkpoint_dir=self.location)

    def log_start(self, identity: dict[str, Any], manifest: Mapping, start_step: int) -> None:
        """Every resolved config key as a param, and the artifacts of this start (config, identity, data, code)."""
        if not (self.is_main and self.recorder.enabled):
            return
        self.recorder.log_params(flatten(identity["config"]))
        self.recorder.log_datasets([DatasetRecord.from_manifest(manifest, self.store, TRAINING)])
        frozen = copy.deepcopy(identity)  # as of this start (the trainer's copy changes under the helper)
        self._start_identity = frozen

        def journal() -> None:
            # Not waiting for the run start: the end of the segment names the run in identity.json.
            self.recorder.log_files(start_artifacts(frozen, manifest, self.run_dir, start_step))

        self._start_files = _Helper(journal, "worldpipe-start-records")

    def _settle_start(self) -> None:
        """Wait for the start's artifacts to be journaled (raising what assembling them raised)."""
        helper, self._start_files = self._start_files, None
        if helper is not None:
            helper.join()

    def add_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int) -> None:
        """Buffer a step's metrics; they reach MLflow once a checkpoint covering the step is durable."""
        self.recorder.add_metrics(step, metrics, timestamp_ms)

    def progress(self, step: int, target_steps: int, loss: float, steps_per_s: float) -> None:
        """Append how far training is to the run directory's progress record (rank 0, at log cadence).

        The MLflow metrics wait for a checkpoint; this line does not, so `worldpipe runs status` shows a running
        job's step, loss and speed wherever it runs (under Snakemake its console goes to a log file).
        """
        if not self.is_main or self._progress_off:
            return
        line = {"step": step, "target_steps": target_steps, "loss": loss, "steps_per_s": steps_per_s,
                "time": time.time()}
        try:
            # Not fsynced: a display aid that a crash may cut harmlessly (readers skip a cut line), and an fsync
            # at every log interval shows in a small model's step time (`worldpipe bench loop`'s "waiting on I/O").
            with open(self.run_dir / PROGRESS_RECORD, "ab") as record:
                record.write((json.dumps(line) + "\n").encode())
        except OSError as err:
            # A display aid: training goes on, and a disk that fails here fails the next checkpoint, which
            # is the error the run reports (naming the step).
            self._progress_off = True
            log.warning("progress record %s not written (%s); `worldpipe runs status` will not follow this run",
                        self.run_dir / PROGRESS_RECORD, err)

    # ---- CheckpointListener ----
    def before_publish(self, step: int, final: bool) -> None:
        """Journal the metrics of steps <= step; they count once this checkpoint is durable.

        The checkpoint about to be written holds the identity dict itself: the run id goes in if the run start
        has been acknowledged by now; only the ``final`` checkpoint waits for that (see the module docstring).
        """
        self._settle_start()
        self._name_run(None, wait=final)
        self.recorder.stage(step)

    def durable(self, step: int, records: Mapping[str, Any], digest: str | None) -> None:
        """Checkpoint ``step`` is durable: release its metrics, record its artifacts (its manifest, now on disk,
        included) and tags."""
        if not self.recorder.enabled:
            return
        self.recorder.commit(step, published_artifacts(step, records, digest, self.location),
                             checkpoint_tags(step, digest))

    def _name_run(self, record: dict[str, Any] | None, wait: bool = True) -> str | None:
        """Put the MLflow run id in the identity and ``record`` (if any): once the run start has been tried, or
        (``wait=False``) if it has been acknowledged by now; returns it.

        Unknown (server not reached yet): both keep what they hold (the resumed checkpoint's id, or None).
        """
        run_id = self.recorder.await_run_id() if wait else self.recorder.run_id
        for target in (self._identity, record):
            if run_id and target is not None:
                target["mlflow_run_id"] = run_id
        if run_id and record is not None and self.recorder.experiment_id:
            # For the run's link (`worldpipe train`'s last line) without asking MLflow; not in the identity, which
            # checkpoints hold.
            record[MLFLOW_EXPERIMENT_KEY] = self.recorder.experiment_id
        return run_id

    def _name_run_in_start_identity(self, run_id: str | None) -> None:
        """Journal this start's ``identity.json`` again, naming the run ``run_id``, if it was journaled before
        the run id was known."""
        frozen = self._start_identity
        if frozen is not None and run_id and frozen.get("mlflow_run_id") != run_id:
            frozen["mlflow_run_id"] = run_id
            self.recorder.log_files({IDENTITY_ARTIFACT: json_artifact(frozen)})

    # ---- endings ----
    def finished(self, record: dict[str, Any]) -> None:
        """Completion record on disk, MLflow run FINISHED."""
        if self.is_main:
            self._settle_start()
            self._name_run_in_start_identity(self._name_run(record))
            (self.run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
            write_text_atomic(self.run_dir / COMPLETION_RECORD, json.dumps(record, indent=2))
            self.recorder.end("FINISHED")

    def preempted(self, record: dict[str, Any]) -> None:
        """Preemption record on disk (the launcher maps it to the requeue exit code), MLflow run KILLED."""
        if self.is_main:
            self._settle_start()
            self._name_run_in_start_identity(self._name_run(record))
            write_text_atomic(self.run_dir / PREEMPTED_RECORD, json.dumps(record, indent=2))
            self.recorder.end("KILLED")

    def failed(self) -> None:
        """The MLflow run says FAILED rather than RUNNING forever; a resume reopens it."""
        if self.is_main:
            try:
                self._settle_start()
            except Exception as err:  # noqa: BLE001 - the run is failing already; its own error is raised
                log.warning("the start's artifacts were not recorded: %s", err)
            self.recorder.end("FAILED")

"""One MLflow run per training run, written by rank 0 only, through a durable spool in the run directory.

Every record is appended to ``RUN_DIR/tracking/journal.jsonl`` (fsync) before it is sent, so a tracking server
that is down at start or mid-run costs nothing: training goes on, a warning says where the records wait, and
the next successful contact (or ``worldpipe tracking sync RUN_DIR``) replays them idempotently.

The courier delivers them (:mod:`worldpipe.tracking.courier`), a child process started with the recorder or
earlier by the launcher, so a slow or hanging server never stalls training. Each append batch wakes it; only the
end waits for delivery. The start does not: the courier creates (or reopens) the run while the first steps run,
and whoever needs the run id asks for it when it does (``run_id`` for a checkpoint, :meth:`RunRecorder.await_run_id`
at the end); system metrics are sampled from the start and logged once the run exists. After a failure the
courier retries by itself with exponential backoff (1 s, 2 s, ... up to ``retry_s``). Where no child process can
be started, the recorder delivers in this process, synchronously, as records are appended (once a retry is due).

Metrics are buffered in memory and *staged* into the journal just before the checkpoint of a step is published
(``stage(step)``), then *committed* once it is durable (``commit(step)``). Staged metrics of a checkpoint that
never became durable are voided by the next start (which resumes from an earlier step and recomputes them), so
a resumed run's history ends equal to an uninterrupted run's: nothing lost, nothing duplicated.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from worldpipe.tracking.connection import fail_fast_over_http, resolve_tracking_uri
from worldpipe.tracking.courier import Courier, adopt_early
from worldpipe.tracking.delivery import DeliveryLoop
from worldpipe.tracking.records import OVERFLOW_ARTIFACT_DIR, split_params
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.tracking")
JOIN_S = 60.0  # how long the end waits for the run start, then for the final delivery


def artifact_records(files: Mapping[str, bytes]) -> list[tuple[str, Mapping[str, bytes], dict[str, str]]]:
    """Spool records (op, files, fields) uploading ``files`` ({artifact path: content}): one per directory."""
    groups: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        directory, _, name = path.rpartition("/")
        groups.setdefault(directory, {})[name] = data
    return [("artifacts", group, {"path": directory}) for directory, group in sorted(groups.items())]


class RunRecorder:
    """Rank-0 MLflow run with a durable spool and checkpoint-gated metrics. A disabled recorder does nothing."""

    def __init__(self, enabled: bool, uri: str | None, experiment: str, run_dir: str | os.PathLike,
                 retry_s: float = 30.0, system_metrics_s: float = 0.0, system_metrics_samples: int = 1,
                 on_opened: Callable[[], None] | None = None):
        self.enabled = enabled
        self.on_opened = on_opened or (lambda: None)  # called once the run exists (on the courier reply thread)
        self.system_metrics_s = system_metrics_s
        self.system_metrics_samples = system_metrics_samples  # averaged into each logged point
        self.experiment = experiment
        self.retry_s = retry_s
        self.uri = resolve_tracking_uri(uri) if enabled else None
        self._pending: list[tuple[int, str, float, int]] = []  # (step, key, value, timestamp_ms)
        self.spool: Spool | None = None
        # Set once a delivery has tried this segment's "open" record (run created/reopened, or server unreachable).
        self._open_tried = threading.Event()
        self._open_seq: int | None = None  # this segment's open record (None: no segment open)
        self._courier: Courier | None = None
        self._local: DeliveryLoop | None = None  # delivery in this process, where no courier could start
        if enabled:
            self.spool = Spool(run_dir)
            # Started now, ahead of the first segment: it imports MLflow while the trainer sets up.
            self._courier = self._spawn_courier(adopt_early(self.spool.run_dir, self.uri))

    @property
    def run_id(self) -> str | None:
        """The MLflow run id if the run has been created (or reopened) by now; never waits."""
        return self.spool.state()["run_id"] if self.spool else None

    @property
    def experiment_id(self) -> str | None:
        """The id of the run's MLflow experiment once the run has been created (or reopened); never waits."""
        return self.spool.state().get("experiment_id") if self.spool else None

    @property
    def courier_pid(self) -> int | None:
        """The PID of the courier while it runs (also in ``RUN_DIR/tracking/courier.json``)."""
        return self._courier.pid if self._courier is not None else None

    # ---- lifecycle ----
    def start(self, run_id: str | None, run_name: str, tags: dict[str, str], resume_step: int = 0,
              checkpoint_dir: str | None = None) -> str | None:
        """Open a segment: create the run, or reopen `run_id` (from the checkpoint) or the run directory's run.

        Returns the run id if known by now (a resumed run directory's), else None: :meth:`await_run_id` waits
        for the start.
        """
        if not self.enabled:
            return None
        os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        fail_fast_over_http()
        self.spool.hold_active()
        self._open_tried.clear()
        self._open_seq = self.spool.append(
            "open", experiment=self.experiment, run_name=run_name, tags=dict(tags), reopen_run_id=run_id,
            record_key=self.spool.record_key(), resume_step=int(resume_step), checkpoint_dir=checkpoint_dir,
            uri=self.uri)
        if self._courier is None or not self._courier.alive():  # a later segment, or a courier that died
            if self._courier is not None:
                self._courier.abandon()  # reaped
            self._courier = self._spawn_courier()
        if self._courier is not None:
            self._courier.wake()  # the waiting courier takes this segment (the journal's newest open record)
            return self.run_id
        self._local = DeliveryLoop(self.spool, self.uri, self.retry_s, on_tried=self._open_tried.set,
                                   on_opened=self.on_opened)
        self._local.begin(self._open_seq, resume_step > 0, self.system_metrics_s, self.system_metrics_samples)
        self._local.deliver_now()
        return self.run_id

    def await_run_id(self) -> str | None:
        """The run id once a delivery has tried this segment's start (None: the server was not reached)."""
        if not self.enabled:
            return None
        if self._open_seq is not None and not self._open_tried.wait(JOIN_S):
            log.warning("the MLflow run start is still in progress after %.0f s; going on without its id",
                        JOIN_S)
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run terminated (FINISHED, FAILED or KILLED) and deliver everything still spooled."""
        if not self.enabled:
            return
        self.await_run_id()
        courier, self._courier = self._courier, None
        if courier is not None and self._open_seq is None:  # never given a segment
            courier.abandon()
            courier = None
        for deliverer in (courier, self._local):
            if deliverer is not None:
                deliverer.stop_sampling()
        self.spool.append("end", status=status)
        outcome = courier.finish(JOIN_S) if courier is not None else "none"  # the final delivery
        if outcome == "busy":
            log.warning("tracking delivery still busy after %.0f s; leaving the rest spooled", JOIN_S)
        elif outcome == "gone":
            log.warning("the tracking courier (pid %d) is gone; delivering in this process", courier.pid)
        if outcome in ("gone", "none"):  # no courier to deliver: this process does
            (self._local or DeliveryLoop(self.spool, self.uri, self.retry_s)).deliver_now()
        self._open_seq = None
        if pending := len(self.spool.pending()):
            log.warning("%d tracking record(s) of this run are still spooled in %s; replay them with: "
                        "worldpipe tracking sync %s", pending, self.spool.journal, self.spool.run_dir)
        self.spool.release_active()

    def abandon(self) -> None:
        """Stop as this process's death would: no final delivery (the courier exits), the run directory free for
        the next start, which (or `worldpipe tracking sync`) delivers what waits in the journal."""
        courier, self._courier, self._open_seq = self._courier, None, None
        if courier is not None:
            courier.abandon()
        if self.spool is not None:
            self.spool.release_active()

    # ---- params, tags, artifacts ----
    def log_params(self, flat: dict[str, Any]) -> None:
        """Log every key; values beyond MLflow's limit are stored whole as artifacts and the param points there."""
        if not self.enabled:
            return
        fitting, overflow = split_params(flat)
        overflow_files = {f"{OVERFLOW_ARTIFACT_DIR}/{key}.txt": text.encode() for key, text in overflow.items()}
        self.spool.append_many([*artifact_records(overflow_files), ("params", None, {"params": fitting})])
        self.deliver()

    def log_files(self, files: Mapping[str, bytes]) -> None:
        """Record artifacts given as {artifact path: content}; contents are spooled before upload."""
        if self.enabled:
            self.spool.append_many(artifact_records(files))
            self.deliver()

    def log_datasets(self, records: list) -> None:
        """Record datasets (``DatasetRecord``) as run inputs: the UI's Dataset column."""
        if self.enabled and records:
            self.spool.append("inputs", datasets=[asdict(r) for r in records])
            self.deliver()

    # ---- metrics ----
    def add_metrics(self, step: int, values: dict[str, float], timestamp_ms: int) -> None:
        """Buffer metrics of a step; they are staged with the next checkpoint covering that step."""
        if self.enabled:
            self._pending.extend((step, key, float(value), timestamp_ms) for key, value in values.items())

    def stage(self, step: int) -> None:
        """Durably journal buffered metrics of steps <= `step`, gated on checkpoint `step` (call before publishing)."""
        if not self.enabled:
            return
        ready = [[s, k, v, ts] for s, k, v, ts in self._pending if s <= step]
        self._pending = [m for m in self._pending if m[0] > step]
        if ready:
            self.spool.append("metrics", gate=int(step), metrics=ready)

    def commit(self, step: int, files: Mapping[str, bytes] | None = None, tags: Mapping[str, str] | None = None) -> None:
        """Checkpoint `step` is durable: release its staged metrics, record its artifacts and tags, replay."""
        if not self.enabled:
            return
        # One journal write (one fsync) for the checkpoint's records: this runs on the training thread.
        records = [("commit", None, {"step": int(step)}), *artifact_records(files or {})]
        if tags:
            records.append(("tags", None, {"tags": {k: str(v) for k, v in tags.items()}}))
        self.spool.append_many(records)
        self.deliver()

    # ---- delivery ----
    def deliver(self) -> None:
        """Records were appended: wake the courier (returns at once). Without one, deliver now, in this thread,
        unless a retry is not due yet. Outside a segment the records wait for its start or end."""
        if self._open_seq is None:
            return
        if self._courier is not None:
            self._courier.wake()
        elif self._local.due():
            self._local.deliver_now()

    def _spawn_courier(self, courier: Courier | None = None) -> Courier | None:
        """``courier`` (one started early), else a new one, ready for its segment and replying to this recorder;
        None (and a warning) if no process could be started."""
        try:
            courier = courier or Courier.start(self.spool, self.uri, self.retry_s, self.system_metrics_s,
                                               self.system_metrics_samples)
        except OSError as err:
            log.warning("the tracking courier could not be started (%s); delivering from this process", err)
            return None
        courier.report_to(self._open_tried.set, self.on_opened)
        return courier

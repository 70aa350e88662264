"""One MLflow run per training run, written by rank 0 only, through a durable spool in the run directory.

Every record is appended to ``RUN_DIR/tracking/journal.jsonl`` (fsync) before it is sent, so a tracking server
that is down at start or mid-run costs nothing: training goes on, a warning says where the records wait, and
the next successful contact (or ``worldpipe tracking sync RUN_DIR``) replays them idempotently.

Delivery runs in a background thread (records are durable before it sees them), so a slow or hanging server
never stalls the training loop; only the end delivers synchronously. The start delivers synchronously too unless
``background_start`` is set: then the run is created (or reopened) by the delivery thread while the first steps
run, and whoever needs the run id asks for it when it does (``run_id`` for a checkpoint,
:meth:`RunRecorder.await_run_id` at the end). Records are journaled in order either way, so nothing a background
start delays is lost or reordered; system metrics are sampled from the start and logged once the run exists. After a
failure the thread retries by itself with exponential backoff (1 s, 2 s, ... up to ``retry_s``), so a server
that comes back mid-run receives everything waiting without a manual sync.

Metrics are buffered in memory and *staged* into the journal just before the checkpoint of a step is published
(``stage(step)``), then *committed* once it is durable (``commit(step)``). Staged metrics of a checkpoint that
never became durable are voided by the next start (which resumes from an earlier step and recomputes them), so
a resumed run's history ends equal to an uninterrupted run's: nothing lost, nothing duplicated.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from worldpipe.config.paths import default_tracking_uri
from worldpipe.tracking.delivery import DeliveryReport, deliver
from worldpipe.tracking.params import OVERFLOW_ARTIFACT_DIR, split_params
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import SystemMetricsSampler

log = logging.getLogger("worldpipe.tracking")

# The training process must not stall for minutes on an unreachable server (MLflow's defaults retry 7 times
# with exponential backoff and wait 120 s per request); records are spooled, so fail fast and retry later.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
# After a failed delivery the background thread retries on its own, first after this many seconds, doubling
# up to `retry_s`: a server that comes back mid-run gets the waiting records without a manual sync.
RETRY_FIRST_S = 1.0
# `WORLDPIPE_TRACKING_START=sync` makes the trainer start the MLflow run before its first step, as it used to
# (for comparison: `worldpipe bench startup` measures both); anything else starts it in the background.
START_ENV = "WORLDPIPE_TRACKING_START"
SYNC_START = "sync"


def fail_fast_over_http() -> None:
    """Make this process's MLflow HTTP calls give up in seconds on an unreachable server (unless the user set
    the MLflow variables): every caller either spools what it could not deliver or reports it in one line."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def background_start_wanted() -> bool:
    """True unless the environment asks for the synchronous run start (the measured baseline)."""
    return os.environ.get(START_ENV, "background") != SYNC_START


def retry_delay(failures: int, first_s: float, cap_s: float) -> float:
    """Seconds before retry number ``failures`` (1-based): exponential backoff from ``first_s``, capped."""
    return min(cap_s, first_s * 2.0 ** max(0, failures - 1))


def resolve_tracking_uri(uri: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else the embedded SQLite file (conf/paths: tracking_db)."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return default_tracking_uri()


def group_files(files: Mapping[str, bytes]) -> dict[str, dict[str, bytes]]:
    """Split artifact paths into {artifact directory: {file name: content}} (one upload per directory)."""
    groups: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        directory, _, name = path.rpartition("/")
        groups.setdefault(directory, {})[name] = data
    return groups


def artifact_records(files: Mapping[str, bytes]) -> list[tuple[str, Mapping[str, bytes], dict[str, str]]]:
    """Spool records (op, files, fields) uploading ``files`` ({artifact path: content}): one per directory."""
    return [("artifacts", group, {"path": directory}) for directory, group in sorted(group_files(files).items())]


class RunRecorder:
    """Rank-0 MLflow run with a durable spool and checkpoint-gated metrics. A disabled recorder does nothing."""

    def __init__(self, enabled: bool, uri: str | None, experiment: str, run_dir: str | os.PathLike | None = None,
                 retry_s: float = 30.0, join_s: float = 60.0, system_metrics_s: float = 0.0,
                 background_start: bool = False, on_opened: Callable[[], None] | None = None,
                 system_metrics_samples: int = 1):
        self.enabled = enabled
        self.background_start = background_start
        self.on_opened = on_opened  # called (on the delivery thread, if started there) once the run exists
        self.system_metrics_s = system_metrics_s
        self.system_metrics_samples = system_metrics_samples  # averaged into each logged point
        self._system_metrics: SystemMetricsSampler | None = None  # this segment's, from its start to its end
        self._system_metrics_attached = False
        self.uri = resolve_tracking_uri(uri) if enabled else None
        self.experiment = experiment
        self.retry_s = retry_s
        self._pending: list[tuple[int, str, float, int]] = []  # (step, key, value, timestamp_ms)
        self._spool: Spool | None = None
        if enabled:
            self._spool = Spool(run_dir if run_dir is not None else tempfile.mkdtemp(prefix="worldpipe-spool-"))
        self.join_s = join_s
        self._failures = 0  # consecutive failed deliveries
        self._retry_at: float | None = None  # monotonic time of the next retry while records wait
        self._offline = False
        self._client = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Set once a delivery has tried this segment's "open" record (run created/reopened, or server unreachable).
        self._open_tried = threading.Event()
        self._open_seq: int | None = None
        self._open_acked = False
        self._resume = False
        self._ending = False
        self._monitor_lock = threading.Lock()  # the delivery thread attaches system metrics, end() stops them

    @property
    def spool(self) -> Spool | None:
        return self._spool

    @property
    def run_id(self) -> str | None:
        """The MLflow run id if the run has been created (or reopened) by now; never waits."""
        return self._spool.state()["run_id"] if self._spool else None

    @property
    def experiment_id(self) -> str | None:
        """The id of the run's MLflow experiment once the run has been created (or reopened); never waits."""
        return self._spool.state().get("experiment_id") if self._spool else None

    # ---- lifecycle ----
    def start(self, run_id: str | None, run_name: str, tags: dict[str, str], resume_step: int = 0,
              checkpoint_dir: str | None = None) -> str | None:
        """Open a segment: create the run, or reopen `run_id` (from the checkpoint) or the run directory's run.

        Returns the run id, or None while the tracking server has not been reached (always, for a fresh run
        started in the background: :meth:`await_run_id` waits for it).
        """
        if not self.enabled:
            return None
        os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        fail_fast_over_http()
        self._spool.hold_active()
        self._resume, self._ending = resume_step > 0, False
        self._open_tried.clear()
        self._open_acked = False
        if self.system_metrics_s and self.system_metrics_s > 0:
            with self._monitor_lock:
                self._system_metrics = SystemMetricsSampler(self.system_metrics_s, self.uri,
                                                            self.system_metrics_samples).start()
                self._system_metrics_attached = False
        self._open_seq = self._spool.append(
            "open", experiment=self.experiment, run_name=run_name, tags=dict(tags), reopen_run_id=run_id,
            record_key=self._spool.record_key(), resume_step=int(resume_step), checkpoint_dir=checkpoint_dir,
            uri=self.uri)
        if not self.background_start:
            self.deliver(force=True)
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._deliver_loop, name="worldpipe-tracking", daemon=True)
            self._thread.start()
        self._wake.set()  # a background start: the thread opens the run now; otherwise a no-op wake-up
        return self.run_id

    def await_run_id(self) -> str | None:
        """The run id once a delivery has tried this segment's start (None: the server was not reached)."""
        if not self.enabled:
            return None
        if self._open_seq is not None and not self._open_tried.wait(self.join_s):
            log.warning("the MLflow run start is still in progress after %.0f s; going on without its id",
                        self.join_s)
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run terminated (FINISHED, FAILED or KILLED) and replay what is still spooled."""
        if not self.enabled:
            return
        self.await_run_id()
        with self._monitor_lock:
            self._attach_system_metrics()  # a segment shorter than the run start still logs its samples
            sampler, self._system_metrics, self._ending = self._system_metrics, None, True
        if sampler is not None:
            sampler.stop()
        self._spool.append("end", status=status)
        self._stop_thread()
        report = self.deliver(force=True) if self._thread is None else None
        if report is None or report.pending:
            log.warning("%d tracking record(s) of this run are still spooled in %s; replay them with: "
                        "worldpipe tracking sync %s", report.pending if report else len(self._spool.pending()),
                        self._spool.journal, self._spool.run_dir)
        self._spool.release_active()

    # ---- params, tags, artifacts ----
    def log_params(self, flat: dict[str, Any]) -> None:
        """Log every key; values beyond MLflow's limit are stored whole as artifacts and the param points there."""
        if not self.enabled:
            return
        fitting, overflow = split_params(flat)
        if overflow:
            self.log_files({f"{OVERFLOW_ARTIFACT_DIR}/{key}.txt": text.encode() for key, text in overflow.items()},
                           deliver=False)
        self._spool.append("params", params=fitting)
        self.deliver()

    def log_files(self, files: Mapping[str, bytes], deliver: bool = True) -> None:
        """Record artifacts given as {artifact path: content}; contents are spooled before upload."""
        if not self.enabled:
            return
        self._spool.append_many(artifact_records(files))
        if deliver:
            self.deliver()

    def log_datasets(self, records: list) -> None:
        """Record datasets (``DatasetRecord``) as run inputs: the UI's Dataset column."""
        if self.enabled and records:
            from dataclasses import asdict

            self._spool.append("inputs", datasets=[asdict(r) for r in records])
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
            self._spool.append("metrics", gate=int(step), metrics=ready)

    def commit(self, step: int, files: Mapping[str, bytes] | None = None, tags: Mapping[str, str] | None = None) -> None:
        """Checkpoint `step` is durable: release its staged metrics, record its artifacts and tags, replay."""
        if not self.enabled:
            return
        # One journal write (one fsync) for the checkpoint's records: this runs on the training thread.
        records = [("commit", None, {"step": int(step)}), *artifact_records(files or {})]
        if tags:
            records.append(("tags", None, {"tags": {k: str(v) for k, v in tags.items()}}))
        self._spool.append_many(records)
        self.deliver()

    # ---- delivery ----
    def deliver(self, force: bool = False) -> DeliveryReport | None:
        """Replay spooled records: `force` now in this thread, else wake the background thread (no waiting)."""
        if not self.enabled:
            return None
        if force or self._thread is None:
            return self._deliver_now()
        self._wake.set()
        return None

    def _deliver_loop(self) -> None:
        """Background delivery: on every wake-up, and after a failure on its own with exponential backoff."""
        while not self._stopping:
            retry_at = self._retry_at
            self._wake.wait(None if retry_at is None else max(0.0, retry_at - time.monotonic()))
            self._wake.clear()
            if self._stopping:
                break
            if self._retry_at is not None and time.monotonic() < self._retry_at:
                continue  # woken early by a new record: it waits with the others until the retry is due
            try:
                self._deliver_now()
            except Exception as err:  # noqa: BLE001 - the thread must survive anything; records stay spooled
                self._note_failure()
                log.warning("tracking delivery failed unexpectedly (%s); records stay spooled", err)

    def _note_failure(self) -> None:
        self._failures += 1
        self._retry_at = time.monotonic() + retry_delay(self._failures, min(RETRY_FIRST_S, self.retry_s),
                                                        self.retry_s)

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(self.join_s)
        if not self._thread.is_alive():
            self._thread = None
        else:
            log.warning("tracking delivery still busy after %.0f s; leaving the rest spooled", self.join_s)

    def _attach_system_metrics(self) -> None:
        """Log system metrics to the run once it exists (call with the monitor lock held)."""
        if (self._system_metrics is not None and not self._system_metrics_attached and not self._ending
                and self.run_id):
            self._system_metrics.attach(self.run_id, resume=self._resume)
            self._system_metrics_attached = True

    def _opened(self) -> None:
        """After a delivery attempt: this segment's start has been tried; start the monitor once the run exists."""
        if self._open_seq is None or self._open_acked:
            return
        self._open_tried.set()
        if self._spool.state()["acked"] >= self._open_seq:
            self._open_acked = True
            if self.on_opened is not None:
                self.on_opened()
            with self._monitor_lock:
                self._attach_system_metrics()

    def _deliver_now(self) -> DeliveryReport:
        try:
            return self._deliver_and_report()
        finally:  # after the warning, if any: whoever waits for the run start sees it said first
            self._opened()

    def _deliver_and_report(self) -> DeliveryReport:
        report = deliver(self._spool, self.uri)
        if report.error:
            self._note_failure()
            if not self._offline:
                log.warning(
                    "MLflow tracking at %s is unreachable (%s). Training continues; %d record(s) are spooled "
                    "durably in %s and will be replayed when the server answers again, or run: "
                    "worldpipe tracking sync %s", self.uri, report.error, report.pending, self._spool.journal,
                    self._spool.run_dir)
            self._offline = True
        else:
            self._failures, self._retry_at = 0, None
            if self._offline:
                log.warning("MLflow tracking at %s is reachable again: replayed %d spooled record(s)", self.uri,
                            report.delivered)
            self._offline = False
        return report

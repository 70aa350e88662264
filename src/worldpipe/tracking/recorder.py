"""One MLflow run per training run, written by rank 0 only, through a durable spool in the run directory.

Every record is appended to ``RUN_DIR/tracking/journal.jsonl`` (fsync) before it is sent, so a tracking server
that is down at start or mid-run costs nothing: training goes on, a warning says where the records wait, and
the next successful contact (or ``worldpipe tracking sync RUN_DIR``) replays them idempotently.

Delivery runs outside the training loop (records are durable before it sees them), so a slow or hanging server
never stalls it: in the courier, a child process that also samples the host's system metrics
(:mod:`worldpipe.tracking.courier`; the trainer's choice, so the training process never imports MLflow), or on a
thread of this process (``courier=False``, the default for direct use; ``WORLDPIPE_TRACKING_DELIVERY=thread``
makes the trainer use it too). Each append batch wakes the deliverer; only the end waits for delivery (``end``:
everything journaled is delivered before it returns). The start waits for the run too unless
``background_start`` is set: then the run is created (or reopened) by the deliverer while the first steps run,
and whoever needs the run id asks for it when it does (``run_id`` for a checkpoint, :meth:`RunRecorder.await_run_id`
at the end). Records are journaled in order either way, so nothing a background start delays is lost or
reordered; system metrics are sampled from the start and logged once the run exists. After a failure the
deliverer retries by itself with exponential backoff (1 s, 2 s, ... up to ``retry_s``), so a server that comes
back mid-run receives everything waiting without a manual sync.

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
from collections.abc import Callable, Mapping
from typing import Any

from worldpipe.config.paths import default_tracking_uri
from worldpipe.tracking.courier import Courier, adopt_early, fail_fast_over_http
from worldpipe.tracking.delivery_loop import DeliveryLoop
from worldpipe.tracking.params import OVERFLOW_ARTIFACT_DIR, split_params
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.tracking")

# `WORLDPIPE_TRACKING_START=sync` makes the trainer start the MLflow run before its first step, as it used to
# (for comparison: `worldpipe bench startup` measures both); anything else starts it in the background.
START_ENV = "WORLDPIPE_TRACKING_START"
SYNC_START = "sync"
# `WORLDPIPE_TRACKING_DELIVERY=thread` makes the trainer deliver on a thread of the training process, as it used
# to (MLflow imported there); anything else delivers from the courier process.
DELIVERY_ENV = "WORLDPIPE_TRACKING_DELIVERY"
THREAD_DELIVERY = "thread"


def background_start_wanted() -> bool:
    """True unless the environment asks for the synchronous run start (the measured baseline)."""
    return os.environ.get(START_ENV, "background") != SYNC_START


def courier_wanted() -> bool:
    """True unless the environment asks for delivery on a thread of the training process."""
    return os.environ.get(DELIVERY_ENV, "courier") != THREAD_DELIVERY


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
                 system_metrics_samples: int = 1, courier: bool = False):
        self.enabled = enabled
        self.background_start = background_start
        self.courier = courier  # deliver from a child process (else on a thread of this one)
        self.on_opened = on_opened  # called (on a delivery or reply thread) once the run exists
        self.system_metrics_s = system_metrics_s
        self.system_metrics_samples = system_metrics_samples  # averaged into each logged point
        self.experiment = experiment
        self.retry_s = retry_s
        self.join_s = join_s
        self._pending: list[tuple[int, str, float, int]] = []  # (step, key, value, timestamp_ms)
        self._spool: Spool | None = None
        self._uri = resolve_tracking_uri(uri) if enabled else None
        if enabled:
            self._spool = Spool(run_dir if run_dir is not None else tempfile.mkdtemp(prefix="worldpipe-spool-"))
        # Set once a delivery has tried this segment's "open" record (run created/reopened, or server unreachable).
        self._open_tried = threading.Event()
        self._open_seq: int | None = None
        self._courier: Courier | None = None  # this segment's courier process
        self._loop: DeliveryLoop | None = None  # delivery in this process (thread mode, or a courier's fallback)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # A courier started now, ahead of the first segment: it imports MLflow while the trainer sets up, so the run
        # start (which the first checkpoint waits for) is not left to the first steps.
        self._ready: Courier | None = None
        if enabled and courier:
            self._ready = (adopt_early(self._spool.run_dir, self._uri, self._open_tried.set, self._opened)
                           or self._spawn_courier(None, False))

    @property
    def uri(self) -> str | None:
        return self._uri

    @uri.setter
    def uri(self, value: str) -> None:
        """Deliver to ``value`` from now on (in this process; a running courier keeps its own)."""
        self._uri = value
        if self._loop is not None:
            self._loop.uri = value
        if self._ready is not None:  # started for the old URI: the segment gets a courier of its own
            self._ready.abandon()
            self._ready = None

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

    @property
    def courier_pid(self) -> int | None:
        """The PID of this segment's courier while it runs (also in ``RUN_DIR/tracking/courier.json``)."""
        return self._courier.pid if self._courier is not None else None

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
        self._open_tried.clear()
        self._open_seq = self._spool.append(
            "open", experiment=self.experiment, run_name=run_name, tags=dict(tags), reopen_run_id=run_id,
            record_key=self._spool.record_key(), resume_step=int(resume_step), checkpoint_dir=checkpoint_dir,
            uri=self.uri)
        if self.courier and self._start_courier(resume_step > 0):
            if not self.background_start:
                self._open_tried.wait()  # set by the courier's report, or by its exit
            return self.run_id
        self._local_loop().begin(self._open_seq, resume_step > 0, self.system_metrics_s,
                                 self.system_metrics_samples)
        if not self.background_start:
            self._loop.deliver_now()
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop.run, args=(self._wait, lambda: self._stopping),
                                            name="worldpipe-tracking", daemon=True)
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
        """Mark the run terminated (FINISHED, FAILED or KILLED) and deliver everything still spooled."""
        if not self.enabled:
            return
        if self._ready is not None:  # never given a segment
            self._ready.abandon()
            self._ready = None
        self.await_run_id()
        courier, self._courier = self._courier, None
        if courier is not None:
            courier.stop_sampling()
        elif self._loop is not None:
            self._loop.stop_sampling()
        self._spool.append("end", status=status)
        pending = self._finish(courier)
        if pending is None or pending:
            log.warning("%d tracking record(s) of this run are still spooled in %s; replay them with: "
                        "worldpipe tracking sync %s", len(self._spool.pending()) if pending is None else pending,
                        self._spool.journal, self._spool.run_dir)
        self._spool.release_active()

    def _finish(self, courier: Courier | None) -> int | None:
        """The final delivery, by the courier or in this process; the records left pending (None: unknown)."""
        if courier is not None:
            outcome, report = courier.finish(self.join_s)
            if outcome == "done":
                return int(report["pending"])
            if outcome == "busy":
                log.warning("tracking delivery still busy after %.0f s; leaving the rest spooled", self.join_s)
                return None
            log.warning("the tracking courier (pid %d) is gone; delivering in this process", courier.pid)
            return self._local_loop().deliver_now().pending
        self._stop_thread()
        return self._local_loop().deliver_now().pending if self._thread is None else None

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
    def deliver(self) -> None:
        """Wake the deliverer: records were appended (returns at once; without a segment open, a recorder
        without a courier delivers now, in this thread)."""
        if not self.enabled:
            return
        if self._courier is not None:
            self._courier.wake()
        elif self._thread is not None:
            self._wake.set()
        elif not self.courier:
            self._local_loop().deliver_now()

    def _wait(self, timeout: float | None) -> None:
        """The delivery thread's wait: a wake-up or the timeout."""
        self._wake.wait(timeout)
        self._wake.clear()

    def _local_loop(self) -> DeliveryLoop:
        if self._loop is None:
            self._loop = DeliveryLoop(self._spool, self.uri, self.retry_s, on_tried=self._open_tried.set,
                                      on_opened=self._opened)
        return self._loop

    def _opened(self) -> None:
        if self.on_opened is not None:
            self.on_opened()

    def _start_courier(self, resume: bool) -> bool:
        """Start this segment's courier; False (and a warning) if no process could be started."""
        if self._courier is not None:
            self._courier.abandon()  # a segment that was never ended
        ready, self._ready = self._ready, None
        if ready is not None and ready.alive():
            self._courier = ready
            ready.wake()  # the open record is journaled: the waiting courier takes this segment
            return True
        self._courier = self._spawn_courier(self._open_seq, resume)
        return self._courier is not None

    def _spawn_courier(self, open_seq: int | None, resume: bool) -> Courier | None:
        try:
            return Courier.start(self._spool, self.uri, open_seq, resume, self.retry_s, self.system_metrics_s,
                                 self.system_metrics_samples, on_tried=self._open_tried.set, on_opened=self._opened)
        except OSError as err:
            log.warning("the tracking courier could not be started (%s); delivering from this process", err)
            return None

    def _stop_thread(self) -> None:
        """Stop delivering without a final delivery (a courier exits as if this process had died)."""
        courier, self._courier = self._courier, None
        if courier is not None:
            courier.abandon()
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(self.join_s)
        if not self._thread.is_alive():
            self._thread = None
        else:
            log.warning("tracking delivery still busy after %.0f s; leaving the rest spooled", self.join_s)

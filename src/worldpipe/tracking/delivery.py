"""Replay a run directory's journal into MLflow: in order, each record exactly once in effect.

Record kinds and why replaying each is idempotent:

- ``open``      start of a training segment. Creates the run (after looking it up by the run directory's record
                key tag, so a create whose answer was lost is not repeated) or reopens the known one.
                ``resume_step`` voids metrics staged for steps after the checkpoint the segment resumed from.
- ``params``    only keys the run lacks are logged; a value changed on resume goes to the tag
                ``worldpipe.changed.<key>`` (MLflow refuses to change a param).
- ``tags``      set_tag overwrites.
- ``artifacts`` upload of its files (``blobs/<seq>/``, and the small text ones journaled ``inline``) under a
                path: overwrites the same files.
- ``metrics``   staged before the checkpoint of ``gate`` is published. Delivered once a later ``commit``
                (checkpoint durable) or ``open`` with ``resume_step >= gate`` confirms them; voided by an ``open``
                that resumed from an earlier step (those steps are recomputed and staged again). The first record
                of a delivery session may have been applied by a process that died before acknowledging it: its
                values already present (same key, step, timestamp, value) are filtered out.
- ``inputs``    datasets as run inputs; one already logged (same name, digest, context) is skipped.
- ``commit``    marker: checkpoint ``step`` is durable.
- ``end``       set_terminated with the recorded end time.

:func:`deliver` replays what is pending once (``worldpipe tracking sync``); a :class:`DeliveryLoop` does it for one
training segment while its records are journaled (in the courier, :mod:`worldpipe.tracking.courier`): with
retries after a failure, one warning per outage, and the host's system metrics beside them.
"""

from __future__ import annotations

import logging
import math
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

from worldpipe.tracking.connection import ensure_experiment, tag_filter, tracking_client, unlogged
from worldpipe.tracking.datasets import DatasetRecord, log_datasets
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import SystemMetricsSampler

log = logging.getLogger("worldpipe.tracking")

RECORD_KEY_TAG = "worldpipe.record_key"
CHANGED_TAG_PREFIX = "worldpipe.changed."
BATCH = {"params": 100, "metrics": 1000, "tags": 100}  # entries per log_batch call, by kind


@dataclass
class DeliveryReport:
    delivered: int = 0
    voided: int = 0
    rejected: int = 0
    pending: int = 0
    run_id: str | None = None
    error: str | None = None


def metric_fate(records: list[dict], index: int, probe: Callable[[int], bool | None] | None) -> str | None:
    """'deliver', 'void' or None (undecided) for the metrics record at ``index``."""
    gate = records[index]["gate"]
    for later in records[index + 1:]:
        if later["op"] == "commit" and later["step"] >= gate:
            return "deliver"
        if later["op"] == "open":
            return "deliver" if later.get("resume_step", 0) >= gate else "void"
    verdict = probe(gate) if probe is not None else None
    return None if verdict is None else "deliver" if verdict else "void"


class _Applier:
    def __init__(self, spool: Spool, client, state: dict):
        self.spool, self.client, self.state = spool, client, state

    @property
    def run_id(self) -> str:
        run_id = self.state["run_id"]
        if not run_id:
            raise RuntimeError("journal holds records before any 'open' record")
        return run_id

    def apply(self, record: dict, first: bool) -> None:
        getattr(self, f"_{record['op']}")(record, first)

    def _open(self, record: dict, _first: bool) -> None:
        from mlflow.entities import RunStatus

        client, state = self.client, self.state
        new_run = state.get("new_run") or {}
        run_id = state["run_id"] or (None if new_run else record.get("reopen_run_id"))
        if run_id is not None:
            state["experiment_id"] = client.get_run(run_id).info.experiment_id  # raises if it does not exist
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = ensure_experiment(client, record["experiment"])
            key = record["record_key"]
            found = client.search_runs([experiment], filter_string=tag_filter({RECORD_KEY_TAG: key}), max_results=1)
            tags = {**record.get("tags", {}), **new_run.get("tags", {}), RECORD_KEY_TAG: key}
            run_id = found[0].info.run_id if found else client.create_run(
                experiment, start_time=record["time_ms"], tags=tags, run_name=record.get("run_name")).info.run_id
            state["experiment_id"] = experiment
            state["run_id"] = run_id
            if new_run.get("copy_history_from"):
                self._copy_history(new_run["copy_history_from"], int(new_run["through_step"]))
            state["new_run"] = None
        self._tags({"tags": record.get("tags", {})}, False)

    def _copy_history(self, source_run: str, through_step: int) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, m.value, m.timestamp, m.step) for key in self.client.get_run(source_run).data.metrics
                   for m in self.client.get_metric_history(source_run, key) if m.step <= through_step]
        self._log("metrics", unlogged(self.client, self.run_id, metrics,
                                      lambda m: (m.key, m.step, m.timestamp, m.value)))

    def _params(self, record: dict, _first: bool) -> None:
        from mlflow.entities import Param

        run = self.client.get_run(self.run_id)
        existing, tags = run.data.params, run.data.tags
        fresh = [Param(k, v) for k, v in sorted(record["params"].items()) if k not in existing]
        # The latest value of a key changed on resume (kept current even if it changes back).
        changed = {f"{CHANGED_TAG_PREFIX}{k}": v for k, v in record["params"].items()
                   if k in existing and (existing[k] != v or f"{CHANGED_TAG_PREFIX}{k}" in tags)}
        self._log("params", fresh)
        self._tags({"tags": changed}, False)

    def _tags(self, record: dict, _first: bool) -> None:
        from mlflow.entities import RunTag

        self._log("tags", [RunTag(k, str(v)) for k, v in sorted(record["tags"].items())])

    def _artifacts(self, record: dict, _first: bool) -> None:
        blob, inline = self.spool.blob_dir(record["seq"]), record.get("inline") or {}
        if blob.exists():
            self.client.log_artifacts(self.run_id, str(blob), record.get("path") or None)
        elif not inline:
            raise RuntimeError(f"files of artifact record {record['seq']} are missing from {blob}")
        for name, text in inline.items():
            self.client.log_text(self.run_id, text, posixpath.join(record.get("path") or "", name))

    def _metrics(self, record: dict, first: bool) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ts, step) for step, key, value, ts in record["metrics"]]
        if first:  # may have been applied already by a process that died before acknowledging it
            metrics = unlogged(self.client, self.run_id, metrics,
                               lambda m: (m.key, m.step, m.timestamp, "nan" if math.isnan(m.value) else m.value))
        self._log("metrics", metrics)

    def _log(self, kind: str, entries: list) -> None:
        """``entries`` of ``kind`` (params, metrics or tags) in batches MLflow accepts."""
        for start in range(0, len(entries), BATCH[kind]):
            self.client.log_batch(self.run_id, **{kind: entries[start:start + BATCH[kind]]})

    def _inputs(self, record: dict, _first: bool) -> None:
        log_datasets(self.client, self.run_id, [DatasetRecord(**fields) for fields in record["datasets"]])

    def _commit(self, _record: dict, _first: bool) -> None:
        pass

    def _end(self, record: dict, _first: bool) -> None:
        self.client.set_terminated(self.run_id, status=record["status"], end_time=record["time_ms"])


def deliver(spool: Spool, uri: str, probe: Callable[[int], bool | None] | None = None,
            on_acked: Callable[[dict], None] = lambda record: None) -> DeliveryReport:
    """Replay pending records of ``spool`` to ``uri``; stops at the first failure or undecided metrics.

    ``probe`` decides staged metrics whose checkpoint outcome the journal does not say (only for a dead
    writer: the caller, which may read checkpoints, passes it). ``on_acked`` is called with each record once its
    acknowledgement is durable (the run id of an ``open`` record is in the state by then).
    """
    report = DeliveryReport()
    with spool.locked():
        state = spool.state()
        entries = spool.read(state["offset"])
        records = [record for record, _ in entries]
        report.run_id = state["run_id"]
        if not entries:
            return report
        try:
            applier = _Applier(spool, tracking_client(uri), state)
        except Exception as err:  # noqa: BLE001 - e.g. an unknown URI scheme: spool and report
            report.error = f"{type(err).__name__}: {err}"
            report.pending = len(entries)
            return report
        for index, (record, end) in enumerate(entries):
            fate = metric_fate(records, index, probe) if record["op"] == "metrics" else "deliver"
            if fate is None:
                break
            if fate == "deliver":
                try:
                    applier.apply(record, first=index == 0)
                except Exception as err:  # noqa: BLE001 - any failure keeps the record pending
                    # Kept pending unless MLflow will never accept it (not a server that is down or busy).
                    if getattr(err, "error_code", None) != "INVALID_PARAMETER_VALUE":
                        report.error = f"{type(err).__name__}: {_short(err)}"
                        break
                    fate = "reject"
                    state["rejected"].append({"seq": record["seq"], "error": _short(err)})
                    log.error("MLflow rejected record %d (%s): %s; kept in %s", record["seq"], record["op"],
                              _short(err), spool.journal)
            report.delivered += fate == "deliver"
            report.voided += fate == "void"
            report.rejected += fate == "reject"
            state["acked"], state["offset"], state["uri"] = record["seq"], end, uri
            spool.save_state(state)
            on_acked(record)
            if record["op"] == "artifacts" and fate == "deliver":
                spool.drop_blobs(record["seq"])  # only after the acknowledgement is durable
        report.run_id = state["run_id"]
        report.pending = len(spool.read(state["offset"]))
    return report


def _short(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + "…"


# After a failed delivery the loop retries on its own, first after this many seconds, doubling up to `retry_s`:
# a server that comes back mid-run gets the waiting records without a manual sync.
RETRY_FIRST_S = 1.0


def retry_delay(failures: int, first_s: float, cap_s: float) -> float:
    """Seconds before retry number ``failures`` (1-based): exponential backoff from ``first_s``, capped."""
    return min(cap_s, first_s * 2.0 ** max(0, failures - 1))


class DeliveryLoop:
    """Replays a spool into MLflow for one segment, on demand and after failures; samples the host meanwhile.

    A segment starts with its ``open`` record (:meth:`begin`): the first delivery attempt after it is reported
    (``on_tried``: whoever needs the run id may now read it from the spool's state), and so is its
    acknowledgement (``on_opened``: the run exists; system metrics taken so far are logged to it from then on).
    """

    def __init__(self, spool: Spool, uri: str, retry_s: float = 30.0,
                 on_tried: Callable[[], None] = lambda: None, on_opened: Callable[[], None] = lambda: None):
        self.spool, self.uri, self.retry_s = spool, uri, retry_s
        self.on_tried, self.on_opened = on_tried, on_opened
        self.retry_at: float | None = None  # monotonic time of the next retry while records wait
        self._failures = 0  # consecutive failed deliveries
        self._offline = False
        self._open_seq: int | None = None
        self._open_tried = self._open_acked = False
        self._sampler: SystemMetricsSampler | None = None  # this segment's, from its start to its end

    def begin(self, open_seq: int, resume: bool, system_metrics_s: float, system_metrics_samples: int) -> None:
        """A segment opened with record ``open_seq``: start sampling the host (every ``system_metrics_s``; 0: off)."""
        self._open_seq, self._open_tried, self._open_acked = open_seq, False, False
        if system_metrics_s and system_metrics_s > 0:
            self._sampler = SystemMetricsSampler(system_metrics_s, self.uri, system_metrics_samples,
                                                 self._opened_run_id, resume).start()

    def stop_sampling(self) -> None:
        """The segment ends: log the last system sample (before the run is marked terminated) and stop."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def _opened_run_id(self) -> str | None:
        """The run id once this segment's open record is acknowledged (a resumed one's may name another run)."""
        state = self.spool.state()
        return state["run_id"] if self._open_seq is not None and state["acked"] >= self._open_seq else None

    def due(self) -> bool:
        """False while a retry is not due yet (new records wait with the others until it is)."""
        return self.retry_at is None or time.monotonic() >= self.retry_at

    def deliver_now(self) -> DeliveryReport:
        """Replay what is pending now; warn once when the server becomes unreachable, once when it is back."""
        try:
            report = deliver(self.spool, self.uri, on_acked=self._acked)
        except Exception as err:  # noqa: BLE001 - delivery must survive anything; records stay spooled
            log.warning("tracking delivery failed unexpectedly (%s); records stay spooled", err)
            report = DeliveryReport(pending=len(self.spool.pending()), error=str(err))
        else:
            if report.error and not self._offline:
                log.warning(
                    "MLflow tracking at %s is unreachable (%s). Training continues; %d record(s) are spooled "
                    "durably in %s and will be replayed when the server answers again, or run: "
                    "worldpipe tracking sync %s", self.uri, report.error, report.pending, self.spool.journal,
                    self.spool.run_dir)
            elif not report.error and self._offline:
                log.warning("MLflow tracking at %s is reachable again: replayed %d spooled record(s)", self.uri,
                            report.delivered)
            self._offline = bool(report.error)
        if report.error:
            self._failures += 1
            self.retry_at = time.monotonic() + retry_delay(self._failures, min(RETRY_FIRST_S, self.retry_s),
                                                           self.retry_s)
        else:
            self._failures, self.retry_at = 0, None
        self._opened()  # after the warning, if any: whoever waits for the run start sees it said first
        return report

    def _acked(self, record: dict) -> None:
        """The segment's start is acknowledged: say so now, not after the rest of the batch (the first one holds
        every config param and the start's artifacts, while the trainer's first checkpoint waits for the run id)."""
        if record["seq"] == self._open_seq:
            self._opened()

    def _opened(self) -> None:
        """After a delivery attempt: the segment's start has been tried; once acknowledged, the run exists."""
        if self._open_seq is None or self._open_acked:
            return
        if not self._open_tried:
            self._open_tried = True
            self.on_tried()
        if self.spool.state()["acked"] >= self._open_seq:
            self._open_acked = True
            self.on_opened()

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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldpipe.core.atomic import fsync_dir, makedirs_durably
from worldpipe.tracking.datasets import DatasetRecord, log_datasets
from worldpipe.tracking.mlflow_import import import_mlflow
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.tracking")

RECORD_KEY_TAG = "worldpipe.record_key"
CHANGED_TAG_PREFIX = "worldpipe.changed."
PARAM_BATCH = 100
METRIC_BATCH = 1000
TAG_BATCH = 100


@dataclass
class DeliveryReport:
    delivered: int = 0
    voided: int = 0
    rejected: int = 0
    pending: int = 0
    run_id: str | None = None
    error: str | None = None
    blocked_on_gate: int | None = None
    messages: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


def metric_fate(records: list[dict], index: int, probe: Callable[[int], bool | None] | None) -> str | None:
    """'deliver', 'void' or None (undecided) for the metrics record at ``index``."""
    gate = records[index]["gate"]
    for later in records[index + 1:]:
        if later["op"] == "commit" and later["step"] >= gate:
            return "deliver"
        if later["op"] == "open":
            return "deliver" if later.get("resume_step", 0) >= gate else "void"
    if probe is not None:
        verdict = probe(gate)
        if verdict is not None:
            return "deliver" if verdict else "void"
    return None


def tracking_client(uri: str):
    """An MLflow client of ``uri``. MLflow caches the store behind it per URI (for SQLite: the engine and the
    schema check, seconds on a cold start), so a first call ahead of the deliveries takes that off their path."""
    import_mlflow()  # the early system-metrics sampler may be importing MLflow in its thread right now
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        create_sqlite_store(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


SCRATCH_STORE = ".{name}.creating-{pid}"  # a SQLite store being created, beside where it will appear


def create_sqlite_store(path: Path) -> None:
    """Make the SQLite store at ``path`` if there is none, so that it appears whole.

    MLflow creates a store's tables one by one, and a process killed half-way leaves a file it can no longer
    open ("table ... already exists"). Here the tables are made in a scratch file beside ``path``, which is then
    linked into place: a kill leaves only the scratch file (removed by the next creator), and of two processes
    creating the same store at once (two training jobs of a pipeline) the second uses the first's.
    """
    if path.exists():
        return
    import psutil
    from mlflow.tracking import MlflowClient

    makedirs_durably(path.parent)  # the store is only as durable as the names leading to it
    # A dead creator's scratch file, and SQLite's rollback journal of it
    scratch_name = re.compile(re.escape(SCRATCH_STORE.format(name=path.name, pid="")) + r"(\d+)(-journal)?")
    for stale in path.parent.iterdir():
        found = scratch_name.fullmatch(stale.name)
        if found and not psutil.pid_exists(int(found[1])):
            stale.unlink(missing_ok=True)
    scratch = path.with_name(SCRATCH_STORE.format(name=path.name, pid=os.getpid()))
    scratch.unlink(missing_ok=True)
    try:
        MlflowClient(tracking_uri=f"sqlite:///{scratch}").search_experiments(max_results=1)  # creates the tables
        with contextlib.suppress(FileExistsError):  # created meanwhile by another process: that one is used
            os.link(scratch, path)
        fsync_dir(path.parent)
    finally:
        scratch.unlink(missing_ok=True)


def _local_artifact_location(client, name: str) -> str | None:
    """Artifacts of a database-file backend beside the database (MLflow's default is ./mlruns of the cwd)."""
    uri = str(client.tracking_uri)
    if not uri.startswith("sqlite:///"):
        return None  # a server decides (proxied artifacts) or the backend's own default
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" / slug).as_uri()


def _experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_local_artifact_location(client, name))
    except MlflowException:  # created concurrently (or by a create whose answer was lost)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


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
            experiment_id = _experiment_id(client, record["experiment"])
            key = record["record_key"]
            found = client.search_runs([experiment_id], filter_string=f"tags.`{RECORD_KEY_TAG}` = '{key}'",
                                       max_results=1)
            if found:
                run_id = found[0].info.run_id
            else:
                tags = {**record.get("tags", {}), **new_run.get("tags", {}), RECORD_KEY_TAG: key}
                run = client.create_run(experiment_id, start_time=record["time_ms"], tags=tags,
                                        run_name=record.get("run_name"))
                run_id = run.info.run_id
            state["experiment_id"] = experiment_id
            state["run_id"] = run_id
            if new_run.get("copy_history_from"):
                self._copy_history(new_run["copy_history_from"], int(new_run["through_step"]))
            state["new_run"] = None
        self._tags({"tags": record.get("tags", {})}, False)

    def _copy_history(self, source_run: str, through_step: int) -> None:
        from mlflow.entities import Metric

        source = self.client.get_run(source_run)
        metrics = []
        for key in source.data.metrics:
            have = {(m.step, m.timestamp, m.value) for m in self.client.get_metric_history(self.run_id, key)}
            for m in self.client.get_metric_history(source_run, key):
                if m.step <= through_step and (m.step, m.timestamp, m.value) not in have:
                    metrics.append(Metric(key, m.value, m.timestamp, m.step))
        self._send_metrics(metrics)

    def _params(self, record: dict, _first: bool) -> None:
        from mlflow.entities import Param

        run = self.client.get_run(self.run_id)
        existing, tags = run.data.params, run.data.tags
        fresh = [Param(k, v) for k, v in sorted(record["params"].items()) if k not in existing]
        # The latest value of a key changed on resume (kept current even if it changes back).
        changed = {f"{CHANGED_TAG_PREFIX}{k}": v for k, v in record["params"].items()
                   if k in existing and (existing[k] != v or f"{CHANGED_TAG_PREFIX}{k}" in tags)}
        for start in range(0, len(fresh), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=fresh[start:start + PARAM_BATCH])
        if changed:
            self._tags({"tags": changed}, False)

    def _tags(self, record: dict, _first: bool) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(k, str(v)) for k, v in sorted(record["tags"].items())]
        for start in range(0, len(tags), TAG_BATCH):
            self.client.log_batch(self.run_id, tags=tags[start:start + TAG_BATCH])

    def _artifacts(self, record: dict, _first: bool) -> None:
        blob, inline = self.spool.blob_dir(record["seq"]), record.get("inline") or {}
        if blob.exists():
            self.client.log_artifacts(self.run_id, str(blob), record.get("path") or None)
        elif not inline:
            raise RuntimeError(f"files of artifact record {record['seq']} are missing from {blob}")
        if inline:
            with tempfile.TemporaryDirectory(prefix="worldpipe-inline-") as staging:
                for name, text in inline.items():
                    target = Path(staging) / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text, encoding="utf-8")
                self.client.log_artifacts(self.run_id, staging, record.get("path") or None)

    def _metrics(self, record: dict, first: bool) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ts, step) for step, key, value, ts in record["metrics"]]
        if first:  # may have been applied already by a process that died before acknowledging it
            present: set = set()
            for key in {m.key for m in metrics}:
                present |= {(key, m.step, m.timestamp, _canon(m.value))
                            for m in self.client.get_metric_history(self.run_id, key)}
            metrics = [m for m in metrics if (m.key, m.step, m.timestamp, _canon(m.value)) not in present]
        self._send_metrics(metrics)

    def _send_metrics(self, metrics: list) -> None:
        for start in range(0, len(metrics), METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + METRIC_BATCH])

    def _inputs(self, record: dict, _first: bool) -> None:

        log_datasets(self.client, self.run_id, [DatasetRecord(**fields) for fields in record["datasets"]])

    def _commit(self, _record: dict, _first: bool) -> None:
        pass

    def _end(self, record: dict, _first: bool) -> None:
        self.client.set_terminated(self.run_id, status=record["status"], end_time=record["time_ms"])


def _canon(value: float) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def _permanent(err: Exception) -> bool:
    """A record MLflow will never accept (as opposed to a server that is down or busy)."""
    return getattr(err, "error_code", None) == "INVALID_PARAMETER_VALUE"


def deliver(spool: Spool, uri: str, probe: Callable[[int], bool | None] | None = None,
            on_acked: Callable[[dict], None] | None = None) -> DeliveryReport:
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
            fate = "deliver"
            if record["op"] == "metrics":
                fate = metric_fate(records, index, probe)
                if fate is None:
                    report.blocked_on_gate = record["gate"]
                    break
            if fate == "deliver":
                try:
                    applier.apply(record, first=index == 0)
                except Exception as err:  # noqa: BLE001 - any failure keeps the record pending
                    if not _permanent(err):
                        report.error = f"{type(err).__name__}: {_short(err)}"
                        break
                    state["rejected"].append({"seq": record["seq"], "error": _short(err)})
                    report.rejected += 1
                    log.error("MLflow rejected record %d (%s): %s; kept in %s", record["seq"], record["op"],
                              _short(err), spool.journal)
                else:
                    report.delivered += 1
            else:
                report.voided += 1
            state["acked"], state["offset"], state["uri"] = record["seq"], end, uri
            spool.save_state(state)
            if on_acked is not None:
                on_acked(record)
            if record["op"] == "artifacts" and fate == "deliver" and not (
                    state["rejected"] and state["rejected"][-1]["seq"] == record["seq"]):
                spool.drop_blobs(record["seq"])  # only after the acknowledgement is durable
        report.run_id = state["run_id"]
        report.pending = len(spool.read(state["offset"]))
    return report


def _short(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + "…"

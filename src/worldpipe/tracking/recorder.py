"""One MLflow run per training run, written by rank 0 only.

Metrics are buffered in memory and flushed only up to a step whose checkpoint is durable. A run that dies
after its last checkpoint therefore never logged the steps it will recompute on resume, and the resumed run's
history ends equal to an uninterrupted run's, without duplicates.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from worldpipe.tracking.params import OVERFLOW_ARTIFACT_DIR, split_params

MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call


def resolve_tracking_uri(uri: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else the embedded SQLite file under ./results."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path('results').resolve() / 'mlflow.db'}"


class RunRecorder:
    """Rank-0 MLflow run with step-gated metric flushing. A disabled recorder does nothing."""

    def __init__(self, enabled: bool, uri: str | None, experiment: str):
        self.enabled = enabled
        self.uri = resolve_tracking_uri(uri) if enabled else None
        self.experiment = experiment
        self.run_id: str | None = None
        self._pending: list[tuple[int, str, float, int]] = []  # (step, key, value, timestamp_ms)
        self._client = None

    def start(self, run_id: str | None, run_name: str, tags: dict[str, str]) -> str | None:
        """Create the run, or reopen `run_id` when resuming. Returns the run id."""
        if not self.enabled:
            return None
        os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        from mlflow.tracking import MlflowClient

        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment = self._client.get_experiment_by_name(self.experiment)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(self.experiment)
            run = self._client.create_run(experiment_id, run_name=run_name, tags=tags)
            run_id = run.info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
            for key, value in tags.items():
                self._client.set_tag(run_id, key, value)
        self.run_id = run_id
        return run_id

    def log_params(self, flat: dict[str, Any]) -> None:
        """Log every key; values beyond MLflow's limit are stored whole as artifacts."""
        if not self.run_id:
            return
        from mlflow.entities import Param

        fitting, overflow = split_params(flat)
        existing = self._client.get_run(self.run_id).data.params
        fresh = [Param(k, v) for k, v in sorted(fitting.items()) if k not in existing]
        for start in range(0, len(fresh), 100):
            self._client.log_batch(self.run_id, params=fresh[start : start + 100])
        for key, text in overflow.items():
            self.log_text(text, f"{OVERFLOW_ARTIFACT_DIR}/{key}.txt")

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store a text artifact at a path inside the run."""
        if self.run_id:
            self._client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a local file or directory."""
        if not self.run_id:
            return
        if Path(path).is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, payload: dict, artifact_file: str) -> None:
        """Store a JSON/YAML artifact."""
        if self.run_id:
            self._client.log_dict(self.run_id, payload, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        if self.run_id:
            self._client.set_tag(self.run_id, key, value)

    def add_metrics(self, step: int, values: dict[str, float], timestamp_ms: int) -> None:
        """Buffer metrics of a step; they reach MLflow at the next flush covering that step."""
        if self.enabled:
            self._pending.extend((step, key, float(value), timestamp_ms) for key, value in values.items())

    def flush(self, up_to_step: int) -> None:
        """Send buffered metrics of steps <= up_to_step (called once that step's checkpoint is durable)."""
        if not self.run_id:
            return
        from mlflow.entities import Metric

        ready = [m for m in self._pending if m[0] <= up_to_step]
        self._pending = [m for m in self._pending if m[0] > up_to_step]
        metrics = [Metric(key, value, ts, step) for step, key, value, ts in ready]
        for start in range(0, len(metrics), MAX_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + MAX_BATCH])

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run terminated (FINISHED, FAILED or KILLED)."""
        if self.run_id:
            self._client.set_terminated(self.run_id, status=status)

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs recorded for a metric, by step."""
        history = self._client.get_metric_history(self.run_id, key)
        return sorted((m.step, m.value) for m in history)


"""Evaluation results on the MLflow run they evaluate, so runs can be compared by quality in the UI.

Metrics (``step`` = imagination horizon, 1-based): ``eval/model_mse``, ``eval/baseline_mse``, ``eval/mse_ratio``;
summaries: ``eval/one_step_ratio`` and ``eval/final_ratio`` (at the last horizon). Tags name the evaluated
checkpoint digest and the held-out dataset hash; ``evaluation/`` holds the metrics file and the plots; the
training and held-out datasets become run inputs.

An evaluation is identified by its key (checkpoint digest, held-out dataset hash, context, horizon). The
training run holds the first evaluation logged to it; another key (a later checkpoint, another horizon) goes
to a nested child run of the training run. The same key logged again changes nothing: a finished evaluation
is skipped, and an interrupted one is completed without repeating the values already there.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worldpipe.tracking.datasets import DatasetRecord, log_datasets

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # which view the MLflow UI opens an experiment in
MODEL_TRAINING_KIND = "custom_model_development"  # the model-training view (runs, charts), not the GenAI one
PARENT_RUN_TAG = "mlflow.parentRunId"
METRIC_PREFIX = "eval/"
KEY_TAG = "worldpipe.eval.key"
COMPLETE_TAG = "worldpipe.eval.complete"
DIGEST_TAG = "worldpipe.eval.checkpoint_digest"
STEP_TAG = "worldpipe.eval.checkpoint_step"
HELDOUT_TAG = "worldpipe.eval.heldout_dataset_hash"
OF_TAG = "worldpipe.eval.of"  # on a child evaluation run: the training run it evaluates
ARTIFACT_DIR = "evaluation"
PER_HORIZON = {"model_mse": "model_mse", "baseline_mse": "baseline_mse", "ratio": "mse_ratio"}
SUMMARY_METRICS = ("one_step_ratio", "final_ratio")


@dataclass(frozen=True)
class EvaluationRecord:
    """One evaluation of one checkpoint of a training run (everything passed in; no checkpoint is read)."""

    run_id: str
    checkpoint_digest: str
    checkpoint_step: int
    result: Mapping[str, Any]  # what worldpipe.evaluate.open_loop.evaluate returns
    artifacts: Mapping[str, str] = field(default_factory=dict)  # local files to attach, by path
    datasets: tuple[DatasetRecord, ...] = ()

    @property
    def key(self) -> str:
        """Identity of the evaluation: same checkpoint, held-out data and lengths give the same key."""
        parts = (self.checkpoint_digest, self.result["heldout_dataset_hash"], self.result["context"],
                 self.result["horizon"])
        return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class EvaluationOutcome:
    run_id: str  # the run the evaluation is on (the training run or its child)
    logged: bool  # False: this key was already complete there
    child: bool


def evaluation_metrics(result: Mapping[str, Any], checkpoint_step: int, timestamp_ms: int) -> list:
    """MLflow metrics of an evaluation result: per horizon (step = horizon) and summaries (step = checkpoint)."""
    from mlflow.entities import Metric

    metrics = []
    for source, name in PER_HORIZON.items():
        for horizon, value in enumerate(result[source], start=1):
            metrics.append(Metric(f"{METRIC_PREFIX}{name}", float(value), timestamp_ms, horizon))
    summaries = {"one_step_ratio": result["ratio"][0], "final_ratio": result["ratio"][-1]}
    metrics += [Metric(f"{METRIC_PREFIX}{k}", float(v), timestamp_ms, checkpoint_step) for k, v in summaries.items()]
    return metrics


def show_in_model_training_view(client, experiment_id: str) -> None:
    """Tag the experiment so the MLflow UI opens it in the model-training view."""
    experiment = client.get_experiment(experiment_id)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)


def _target_run(client, run, key: str, step: int) -> tuple[Any, bool]:
    """The run an evaluation with ``key`` goes to, claimed for it; (run, is_child)."""
    tags = run.data.tags
    if tags.get(KEY_TAG) in (None, key):
        if tags.get(KEY_TAG) is None:
            client.set_tag(run.info.run_id, KEY_TAG, key)
        return client.get_run(run.info.run_id), False
    experiment_id = run.info.experiment_id
    found = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`{KEY_TAG}` = '{key}' AND tags.`{OF_TAG}` = '{run.info.run_id}'"))
    if found:
        return found[0], True
    name = f"{run.info.run_name or run.info.run_id[:8]}-eval-step-{step:06d}"
    child = client.create_run(experiment_id, run_name=name, tags={
        PARENT_RUN_TAG: run.info.run_id, OF_TAG: run.info.run_id, KEY_TAG: key})
    return child, True


def _fresh(client, run_id: str, metrics: list) -> list:
    """Metrics not yet in the run (same key, step and value): an interrupted attempt is not repeated."""
    present = set()
    for name in {m.key for m in metrics}:
        present |= {(name, m.step, m.value) for m in client.get_metric_history(run_id, name)}
    return [m for m in metrics if (m.key, m.step, m.value) not in present]


def log_evaluation(uri: str, record: EvaluationRecord) -> EvaluationOutcome:
    """Log an evaluation onto its training run (or a child run of it); idempotent per evaluation key."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(record.run_id)
    show_in_model_training_view(client, run.info.experiment_id)
    key = record.key
    target, child = _target_run(client, run, key, record.checkpoint_step)
    run_id = target.info.run_id
    if target.data.tags.get(COMPLETE_TAG) == key:
        return EvaluationOutcome(run_id, logged=False, child=child)
    metrics = _fresh(client, run_id, evaluation_metrics(record.result, record.checkpoint_step,
                                                        int(time.time() * 1000)))
    tags = [RunTag(DIGEST_TAG, record.checkpoint_digest), RunTag(STEP_TAG, str(record.checkpoint_step)),
            RunTag(HELDOUT_TAG, str(record.result["heldout_dataset_hash"]))]
    client.log_batch(run_id, metrics=metrics, tags=tags)
    for path in record.artifacts.values():
        client.log_artifact(run_id, path, ARTIFACT_DIR)
    for run_with_inputs in {record.run_id, run_id}:  # the training run, and the child run if there is one
        log_datasets(client, run_with_inputs, list(record.datasets))
    client.set_tag(run_id, COMPLETE_TAG, key)  # last: marks the evaluation whole
    return EvaluationOutcome(run_id, logged=True, child=child)

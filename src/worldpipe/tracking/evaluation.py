"""Open- and closed-loop evaluation results on the MLflow run they evaluate: runs compared by quality in the UI.

Every metric is logged at the evaluated checkpoint's training step, so the UI's "Step" axis means training step
in every chart of the run. The horizon is in the name: ``eval/per_horizon/model_mse/h01``,
``eval/per_horizon/baseline_mse/h01``, ``eval/per_horizon/mse_ratio/h01`` ... (1-based, zero-padded so they
sort); frame models add ``pixel_mse``, ``baseline_pixel_mse``, ``pixel_ratio``, ``psnr`` and ``baseline_psnr`` by
horizon; summaries ``eval/one_step_ratio`` and
``eval/final_ratio`` (at the last horizon). Error against horizon is drawn where horizon is the axis: the
``evaluation/by_horizon.json`` table (MLflow's table JSON: columns, data) and the plot beside it. Tags name the
evaluated checkpoint digest and the held-out dataset hash; ``evaluation/`` also holds the metrics file; the
training and held-out datasets become run inputs. The logged model of the checkpoint gets the same metrics
(and the training loss at its step), each naming the dataset it was measured on, so its page lists them and
the datasets it used.

An evaluation is identified by its key (checkpoint digest, held-out dataset hash, context, horizon). The
training run holds the first evaluation logged to it; another key (a later checkpoint, another horizon) goes
to a nested child run of the training run. The same key logged again changes nothing: a finished evaluation
is skipped, and an interrupted one is completed without repeating the values already there.

Closed-loop evaluations (control) log returns per episode and their summaries, on the run and its logged model.
A control evaluation goes to a nested child run of the training run (``<run>-control-<planner>``): its "Step" axis
is the held-out episode, so ``control/<contender>/return`` at step i is episode i's return (the training run keeps
training steps on its axis). The training run gets the summaries at the evaluated checkpoint's step
(``control/<contender>/return_mean``, ``.../return_ci95_low``, ``.../return_ci95_high``, ``control/score``,
``control/ceiling_score``, ``control/behaviour_score``, ``control/decision_p99_ms`` and, where the loop was probed
over HTTP, ``control/http_probe/decision_p99_ms``), and so does the logged model of the checkpoint, where one
exists, together with the planner's per-episode returns. The HTTP probe is timing, never a return or a score. Idempotent per evaluation key (checkpoint digest and
settings): the same evaluation logged twice adds nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worldpipe.config.identity import flatten
from worldpipe.tracking.connection import client_for, tag_filter, unlogged
from worldpipe.tracking.datasets import DIGEST_CHARS, EVALUATION, TRAINING, DatasetRecord, log_datasets

# The experiment's kind, as MLflow's experiment settings show it (the layout a link opens is the URL's: links.py)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"  # the model-training view (runs, charts), not the GenAI one
PARENT_RUN_TAG = "mlflow.parentRunId"
METRIC_PREFIX = "eval/"
PER_HORIZON_PREFIX = f"{METRIC_PREFIX}per_horizon/"
KEY_TAG = "worldpipe.eval.key"
COMPLETE_TAG = "worldpipe.eval.complete"
DIGEST_TAG = "worldpipe.eval.checkpoint_digest"
STEP_TAG = "worldpipe.eval.checkpoint_step"
HELDOUT_TAG = "worldpipe.eval.heldout_dataset_hash"
OF_TAG = "worldpipe.eval.of"  # on a child evaluation run: the training run it evaluates
ARTIFACT_DIR = "evaluation"
HORIZON_TABLE = "by_horizon.json"  # in ARTIFACT_DIR: one row per horizon
TRAINING_LOSS = "loss/total"  # the training metric the logged model carries (at its checkpoint's step)
PER_HORIZON = {"model_mse": "model_mse", "baseline_mse": "baseline_mse", "ratio": "mse_ratio"}
# Frame models' results also carry pixel-space errors (values in [0, 1]) and PSNR in dB.
PIXEL_PER_HORIZON = ("pixel_mse", "baseline_pixel_mse", "pixel_ratio", "psnr", "baseline_psnr")
SUMMARY_METRICS = ("one_step_ratio", "final_ratio")
CONTROL_PREFIX = "control/"
CONTROL_KEY_TAG = "worldpipe.control.key"
CONTROL_COMPLETE_TAG = "worldpipe.control.complete"
CONTROL_DIGEST_TAG = "worldpipe.control.checkpoint_digest"
CONTROL_ARTIFACT_DIR = "control"
# Measured by the clock (they differ run to run); every other control metric is a function of the records.
CLOCK_METRICS = (f"{CONTROL_PREFIX}decision_p99_ms", f"{CONTROL_PREFIX}http_probe/decision_p99_ms")


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
    """MLflow metrics of an evaluation result, all at the checkpoint's training step: per horizon
    (``eval/per_horizon/<name>/hNN``, zero-padded so the names sort by horizon, and after the summaries: the UI's
    compare view lists metrics by name in a short scrolled box) and summaries."""
    from mlflow.entities import Metric

    values = {}
    per_horizon = {**PER_HORIZON, **{k: k for k in PIXEL_PER_HORIZON if k in result}}
    for source, name in per_horizon.items():
        width = max(2, len(str(len(result[source]))))
        for horizon, value in enumerate(result[source], start=1):
            values[f"{PER_HORIZON_PREFIX}{name}/h{horizon:0{width}d}"] = value
    values[f"{METRIC_PREFIX}one_step_ratio"] = result["ratio"][0]
    values[f"{METRIC_PREFIX}final_ratio"] = result["ratio"][-1]
    return [Metric(key, float(value), timestamp_ms, checkpoint_step) for key, value in values.items()]


def show_in_model_training_view(client, experiment_id: str) -> None:
    """Tag the experiment as model training (its kind in the UI's settings; the layout comes from the link)."""
    experiment = client.get_experiment(experiment_id)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)


def child_run(client, run, suffix: str, tags: Mapping[str, str]):
    """The child run of ``run`` that carries ``tags`` (an evaluation's key), created as ``<run name>-<suffix>``
    with them if there is none yet."""
    found = client.search_runs([run.info.experiment_id], max_results=1,
                               filter_string=tag_filter({**tags, OF_TAG: run.info.run_id}))
    if found:
        return found[0]
    name = f"{run.info.run_name or run.info.run_id[:8]}-{suffix}"
    return client.create_run(run.info.experiment_id, run_name=name,
                             tags={PARENT_RUN_TAG: run.info.run_id, OF_TAG: run.info.run_id, **tags})


def log_once(client, run, complete_tag: str, key: str, child: bool, log: Callable[[str], None]) -> bool:
    """Call ``log(run_id)`` and then tag ``run`` whole for ``key`` (last: the tag marks the evaluation whole),
    unless it is whole already (False). A child run ends FINISHED: it measured once, it does not go on running
    (a run left RUNNING shows a spinner and no duration in the UI forever); FAILED if ``log`` raises (the next
    attempt finds the run by its key and completes it). A run that is not a child is left as it is."""
    run_id = run.info.run_id
    whole = run.data.tags.get(complete_tag) == key
    if not whole:
        try:
            log(run_id)
            client.set_tag(run_id, complete_tag, key)
        except BaseException:
            if child:
                client.set_terminated(run_id, "FAILED")
            raise
    if child and (not whole or run.info.status != "FINISHED"):
        client.set_terminated(run_id, "FINISHED")
    return not whole


def log_evaluation(uri: str, record: EvaluationRecord) -> EvaluationOutcome:
    """Log an evaluation onto its training run (or a child run of it); idempotent per evaluation key."""
    from mlflow.entities import RunTag

    client = client_for(uri)
    run = client.get_run(record.run_id)
    show_in_model_training_view(client, run.info.experiment_id)
    key = record.key
    child = run.data.tags.get(KEY_TAG) not in (None, key)  # the training run holds its first evaluation only
    if child:
        run = child_run(client, run, f"eval-step-{record.checkpoint_step:06d}", {KEY_TAG: key})
    elif run.data.tags.get(KEY_TAG) is None:
        client.set_tag(run.info.run_id, KEY_TAG, key)

    def log(run_id: str) -> None:
        metrics = unlogged(client, run_id, evaluation_metrics(record.result, record.checkpoint_step,
                                                              int(time.time() * 1000)),
                           lambda m: (m.key, m.step, m.value))  # an interrupted attempt is not repeated
        tags = [RunTag(DIGEST_TAG, record.checkpoint_digest), RunTag(STEP_TAG, str(record.checkpoint_step)),
                RunTag(HELDOUT_TAG, str(record.result["heldout_dataset_hash"]))]
        client.log_batch(run_id, metrics=metrics, tags=tags)
        for path in record.artifacts.values():
            client.log_artifact(run_id, path, ARTIFACT_DIR)
        # Error by horizon as MLflow's table JSON (columns, data), one row per horizon; written whole: an
        # interrupted attempt's upload is replaced, not appended.
        rows = zip(*(record.result[source] for source in PER_HORIZON), strict=True)
        client.log_dict(run_id, {"columns": ["horizon", *PER_HORIZON.values()],
                                 "data": [[h, *map(float, row)] for h, row in enumerate(rows, start=1)]},
                        f"{ARTIFACT_DIR}/{HORIZON_TABLE}")
        for run_with_inputs in {record.run_id, run_id}:  # the training run, and the child run if there is one
            log_datasets(client, run_with_inputs, list(record.datasets))

    logged = log_once(client, run, COMPLETE_TAG, key, child, log)
    return EvaluationOutcome(run.info.run_id, logged=logged, child=child)


def _dataset_of(record: EvaluationRecord, context: str) -> dict[str, str]:
    """``dataset_name``/``dataset_digest`` of the record's dataset in ``context`` (as its run input names it)."""
    for dataset in record.datasets:
        if dataset.context == context:
            return {"dataset_name": dataset.name, "dataset_digest": dataset.dataset_hash[:DIGEST_CHARS]}
    return {}


def latest_metric(client, run_id: str, key: str, step: float = math.inf):
    """The metric ``key`` as run ``run_id`` holds it at ``step`` (the last one at or before it), None if none."""
    history = [m for m in client.get_metric_history(run_id, key) if m.step <= step]
    return max(history, key=lambda m: (m.step, m.timestamp)) if history else None


def log_model_evaluation(uri: str, record: EvaluationRecord, eval_run_id: str, model_id: str) -> int:
    """Put the evaluation's metrics (and so its datasets) on logged model ``model_id``; the number of metrics
    added (none when the model has them already: idempotent like :func:`log_evaluation`).

    The model carries the evaluation's metrics as run ``eval_run_id`` holds them, naming the held-out dataset, and
    the training run's loss at the checkpoint's step, naming the training dataset. Same values, steps and
    timestamps as the runs' own: logging them adds no run metric.
    """
    from mlflow.entities import Metric

    client = client_for(uri)
    keys = [m.key for m in evaluation_metrics(record.result, record.checkpoint_step, 0)]
    sources = [(eval_run_id, key, _dataset_of(record, EVALUATION)) for key in keys]
    sources.append((record.run_id, TRAINING_LOSS, _dataset_of(record, TRAINING)))
    present = {(m.key, m.step, m.run_id) for m in (client.get_logged_model(model_id).metrics or [])}
    fresh = []
    for run_id, key, dataset in sources:
        logged = latest_metric(client, run_id, key, record.checkpoint_step)
        if logged is not None and (key, logged.step, run_id) not in present:
            fresh.append(Metric(key, logged.value, logged.timestamp, logged.step, model_id=model_id,
                                run_id=run_id, **dataset))
    for run_id in dict.fromkeys(m.run_id for m in fresh):
        client.log_batch(run_id, metrics=[m for m in fresh if m.run_id == run_id])
    return len(fresh)


def control_key(result: Mapping[str, Any]) -> str:
    """Identity of a control evaluation: the checkpoint digest and every setting."""
    text = json.dumps({"digest": result["checkpoint_digest"], "settings": result["settings"]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def control_summaries(result: Mapping[str, Any]) -> dict[str, float]:
    """The summaries the training run and the logged model carry (name -> value)."""
    values: dict[str, float] = {}
    for name, c in result["contenders"].items():
        values[f"{CONTROL_PREFIX}{name}/return_mean"] = c["mean"]
        values[f"{CONTROL_PREFIX}{name}/return_ci95_low"], values[f"{CONTROL_PREFIX}{name}/return_ci95_high"] = c["ci95"]
    for key in ("score", "ceiling_score", "behaviour_score"):
        if result.get(key) is not None:
            values[f"{CONTROL_PREFIX}{key}"] = result[key]
    decision, probe = CLOCK_METRICS
    values[decision] = result["contenders"]["planner"]["control_loop"]["decision_p99_ms"]
    if "http_probe" in result:
        values[probe] = result["http_probe"]["control_loop"]["decision_p99_ms"]
    return values


def control_summary_keys(keys: set[str]) -> list[str]:
    """The closed-loop summaries among a run's metric names, in reading order: the scores, then the planner's
    return, then every other contender's and the loop's clock (per-episode histories are the child run's)."""
    summaries = [k for k in keys if k.startswith(CONTROL_PREFIX) and not k.endswith("/return")]

    def rank(key: str) -> tuple[int, str]:
        name = key[len(CONTROL_PREFIX):]
        scalar = "/" not in name
        first = 0 if name == "score" else 1 if scalar and name.endswith("score") else 2 if name.startswith(
            "planner/") else 3
        return first, name

    return sorted(summaries, key=rank)


def log_control(uri: str, run_id: str, result: Mapping[str, Any], files: Sequence[str],
                model_id: str | None) -> str:
    """Log a control evaluation of run ``run_id`` (and onto logged model ``model_id``); the child run's id."""
    from mlflow.entities import Metric, Param

    client = client_for(uri)
    key = control_key(result)
    planner = str(result["settings"]["planner"].get("_target_", "")).rsplit(".", 1)[-1]
    # The digest tag names the key, kept short for the UI's tag column.
    child = child_run(client, client.get_run(run_id), f"control-{planner}", {CONTROL_KEY_TAG: key, CONTROL_DIGEST_TAG: key[:16]})

    def log(child_id: str) -> None:
        now, step = int(time.time() * 1000), int(result["checkpoint_step"])
        per_episode = [Metric(f"{CONTROL_PREFIX}{name}/return", float(value), now, i)
                       for name, c in result["contenders"].items() for i, value in enumerate(c["returns"])]
        summaries = [Metric(k, float(v), now, step) for k, v in control_summaries(result).items()]
        # An empty mapping (a planner's defaults) has no keys to record.
        params = [Param(f"control.{k}", str(v)) for k, v in flatten(result["settings"]).items() if v != {}]
        client.log_batch(child_id, metrics=per_episode + summaries, params=params)
        for path in files:
            client.log_artifact(child_id, path, CONTROL_ARTIFACT_DIR)
        client.log_batch(run_id, metrics=summaries)
        if model_id is not None:
            planner_returns = [m for m in per_episode if m.key == f"{CONTROL_PREFIX}planner/return"]
            client.log_batch(child_id, metrics=[Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id,
                                                       run_id=child_id) for m in planner_returns + summaries])

    log_once(client, child, CONTROL_COMPLETE_TAG, key, True, log)
    return child.info.run_id

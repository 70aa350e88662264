"""Bridge from an evaluated checkpoint to its MLflow records: the evaluation, the datasets, the model.

Reads what the checkpoint and the manifests say (run id, digest, config, weights) and passes plain values to
``worldpipe.tracking``, which never reads checkpoints itself.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from worldpipe.checkpoint import CheckpointManager, state_digest
from worldpipe.config.paths import COMPLETION_RECORD
from worldpipe.data.manifest import load_manifest
from worldpipe.evaluate.logged_model import ModelRecord, log_world_model
from worldpipe.tracking.connection import fail_fast_over_http, resolve_tracking_uri
from worldpipe.tracking.datasets import EVALUATION, TRAINING, DatasetRecord
from worldpipe.tracking.evaluation import EvaluationRecord, log_evaluation, log_model_evaluation
from worldpipe.tracking.links import model_url, run_url

log = logging.getLogger("worldpipe.evaluate.open_loop")
MODELS_SCHEME = "models:/"  # a logged model's URI: models:/<model id>
EXAMPLE_SEGMENTS = 2  # held-out segments kept as the logged model's input example


@dataclass(frozen=True)
class EvaluationInputs:
    """Where an evaluation read from and what it wrote (the CLI's arguments)."""
    checkpoints: str
    store: str
    manifest: str
    files: dict[str, str]  # local files to attach: metrics JSON, plots
    predictions: str  # npz written by evaluate(): obs, action, predicted


def _datasets(identity: dict, inputs: EvaluationInputs) -> tuple[DatasetRecord, ...]:
    records = [DatasetRecord.from_manifest(load_manifest(inputs.manifest), inputs.store, EVALUATION)]
    data_cfg = identity.get("config", {}).get("data", {})
    try:
        train_manifest = load_manifest(str(data_cfg["manifest"]))
    except (KeyError, OSError, ValueError) as err:  # moved or deleted since training: hash from the identity only
        log.warning("training dataset manifest unreadable (%s); its input is logged without a schema", err)
        train_manifest = {"dataset_hash": identity["dataset_hash"], "spec": {"name": "train"}, "arrays": {}}
    records.insert(0, DatasetRecord.from_manifest(train_manifest, str(data_cfg.get("store", "")), TRAINING))
    return tuple(records)


def recorded_run_id(checkpoints: str) -> str | None:
    """The run id in the completion record beside the checkpoints: set by `worldpipe tracking sync` for a run
    whose tracking was unreachable from the start (its checkpoints then record no run id)."""
    done = Path(checkpoints).parent / COMPLETION_RECORD
    try:
        return json.loads(done.read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


def checkpoint_state(checkpoints: str, step: int) -> tuple[dict, str]:
    """The state of a published step and its digest."""
    state = CheckpointManager(checkpoints).load(step)
    return state, state_digest(state)


@dataclass(frozen=True)
class Recorded:
    """Where an evaluation went in MLflow, with the UI links (Model training view) to print."""
    run_id: str
    run_url: str
    model_url: str | None


def record_evaluation(result: dict[str, Any], inputs: EvaluationInputs, uri: str | None,
                      register_as: str | None = None, log_model: bool = True) -> Recorded | None:
    """Log an evaluation result (and the evaluated model, with the evaluation's metrics and datasets) to MLflow;
    where it went, None if the training ran untracked."""
    run_id = result.get("mlflow_run_id") or recorded_run_id(inputs.checkpoints)
    if not run_id:
        log.warning("the checkpoint records no MLflow run (training ran without tracking); nothing logged")
        return None
    fail_fast_over_http()
    state, digest = checkpoint_state(inputs.checkpoints, result["checkpoint_step"])
    identity = state["identity"]
    uri = resolve_tracking_uri(uri or identity.get("config", {}).get("tracking", {}).get("uri"))
    record = EvaluationRecord(run_id=run_id, checkpoint_digest=digest, checkpoint_step=result["checkpoint_step"],
                              result=result, artifacts=inputs.files, datasets=_datasets(identity, inputs))
    outcome = log_evaluation(uri, record)
    log.info("evaluation %s run %s%s", "logged to" if outcome.logged else "already on",
             outcome.run_id, " (child of the training run)" if outcome.child else "")
    experiment_id = MlflowClient(uri).get_run(outcome.run_id).info.experiment_id
    model_link = None
    if log_model:
        model_id = _log_model(uri, run_id, state, digest, result, inputs, register_as or
                              identity["config"].get("tracking", {}).get("register_as"))
        added = log_model_evaluation(uri, record, outcome.run_id, model_id)
        log.info("model %s carries the evaluation (%d metrics added)", model_id, added)
        model_link = model_url(uri, experiment_id, model_id)
    return Recorded(outcome.run_id, run_url(uri, experiment_id, outcome.run_id), model_link)


def _log_model(uri: str, run_id: str, state: dict, digest: str, result: dict[str, Any], inputs: EvaluationInputs,
               register_as: str | None) -> str:
    """Log the evaluated checkpoint's model into the training run (once per digest); its model id."""
    with np.load(inputs.predictions) as arrays:
        context = int(result["context"])
        obs = arrays["obs"][:EXAMPLE_SEGMENTS, :context]
        action = arrays["action"][:EXAMPLE_SEGMENTS]
    model = ModelRecord(state_dict=state["model"], model_config=state["identity"]["config"]["model"],
                        obs_dim=int(obs.shape[2]), act_dim=int(action.shape[2]), checkpoint_digest=digest,
                        checkpoint_step=result["checkpoint_step"], example_obs=obs, example_action=action)
    model_uri = log_world_model(uri, run_id, model, register_as)
    log.info("model logged as %s%s", model_uri, f" (registered as {register_as})" if register_as else "")
    return model_uri.removeprefix(MODELS_SCHEME)

"""Bridge from an evaluated checkpoint to its MLflow records: the evaluation, the datasets, the model.

Reads what the checkpoint and the manifests say (run id, digest, config, weights) and passes plain values to
``worldpipe.tracking``, which never reads checkpoints itself.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worldpipe.checkpoint import CheckpointManager, state_digest
from worldpipe.config.paths import COMPLETION_RECORD
from worldpipe.data.manifest import load_manifest
from worldpipe.evaluate.logged_model import ModelRecord, log_world_model
from worldpipe.tracking.datasets import EVALUATION, TRAINING, DatasetRecord
from worldpipe.tracking.evaluation import EvaluationRecord, log_evaluation
from worldpipe.tracking.recorder import HTTP_DEFAULTS, resolve_tracking_uri

log = logging.getLogger("worldpipe.evaluate.open_loop")
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


def record_evaluation(result: dict[str, Any], inputs: EvaluationInputs, uri: str | None,
                      register_as: str | None = None, log_model: bool = True) -> str | None:
    """Log an evaluation result (and the evaluated model) to MLflow; the run it went to, None if untracked."""
    run_id = result.get("mlflow_run_id") or recorded_run_id(inputs.checkpoints)
    if not run_id:
        log.warning("the checkpoint records no MLflow run (training ran without tracking); nothing logged")
        return None
    for key, value in HTTP_DEFAULTS.items():  # an unreachable server: fail in seconds, not minutes
        os.environ.setdefault(key, value)
    state, digest = checkpoint_state(inputs.checkpoints, result["checkpoint_step"])
    identity = state["identity"]
    uri = resolve_tracking_uri(uri or identity.get("config", {}).get("tracking", {}).get("uri"))
    record = EvaluationRecord(run_id=run_id, checkpoint_digest=digest, checkpoint_step=result["checkpoint_step"],
                              result=result, artifacts=inputs.files, datasets=_datasets(identity, inputs))
    outcome = log_evaluation(uri, record)
    log.info("evaluation %s run %s%s", "logged to" if outcome.logged else "already on",
             outcome.run_id, " (child of the training run)" if outcome.child else "")
    if log_model:
        with np.load(inputs.predictions) as arrays:
            context = int(result["context"])
            obs = arrays["obs"][:EXAMPLE_SEGMENTS, :context]
            action = arrays["action"][:EXAMPLE_SEGMENTS]
        model_cfg = identity["config"]["model"]
        register_as = register_as or identity["config"].get("tracking", {}).get("register_as")
        model = ModelRecord(state_dict=state["model"], model_config=model_cfg, obs_dim=int(obs.shape[2]),
                            act_dim=int(action.shape[2]), checkpoint_digest=digest,
                            checkpoint_step=result["checkpoint_step"], example_obs=obs, example_action=action)
        model_uri = log_world_model(uri, run_id, model, register_as)
        log.info("model logged as %s%s", model_uri, f" (registered as {register_as})" if register_as else "")
    return outcome.run_id


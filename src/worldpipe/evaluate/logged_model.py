"""A trained world model as an MLflow model: a pyfunc that runs open-loop prediction.

Input (raw observation units): ``obs`` [N,C,O] — the C context observations — and ``action`` [N,T,A] with
T > C; output: the predicted observations of steps C..T-1, [N,T-C,O], exactly what ``worldpipe evaluate``
computes on the same inputs. The model directory holds the weights (loaded with ``weights_only``) and a JSON
spec (model config, sizes, checkpoint digest) and, instead of a pickle, the few lines of model code MLflow runs
at load time; loading it needs the installed ``worldpipe`` package only.

Logging is idempotent: a run's model of a given checkpoint digest is logged once, and a registered model gets
at most one version per digest (the version carries the digest as a tag).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types.schema import Schema, TensorSpec

from worldpipe.models.open_loop import predict_observations
from worldpipe.models.restore import DIMS_KEY, model_dims_record, restore_model
from worldpipe.tracking.records import CHECKPOINT_DIGEST_TAG as DIGEST_TAG
from worldpipe.tracking.records import CHECKPOINT_STEP_TAG as STEP_TAG

MODEL_NAME = "world_model"  # the logged model's name within its run
MODEL_CODE = Path(__file__).with_name("pyfunc_model_code.py")  # models from code: no pickled object
WEIGHTS, SPEC = "weights", "spec"
# MLflow copies onto a new logged model every run metric logged at the `step` it is logged at (default 0) — on a
# training run that is system metrics' first sample. The model gets its own metrics, each naming its dataset
# (worldpipe.tracking.evaluation.log_model_evaluation), so it is logged at a step no run metric has.
NO_RUN_METRICS_STEP = -1


class OpenLoopPredictor(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: ``predict({"obs": [N,C,O], "action": [N,T,A]}) -> [N,T-C,O]`` (float32)."""
    def load_context(self, context) -> None:
        """Build the model from its spec and load its weights (no code runs from the files themselves)."""

        spec = json.loads(Path(context.artifacts[SPEC]).read_text())
        weights = torch.load(context.artifacts[WEIGHTS], weights_only=True)
        dims = model_dims_record(spec["obs_dim"], spec["act_dim"])
        self.model = restore_model(spec["model"], weights, {DIMS_KEY: dims})

    def predict(self, context, model_input, params=None):  # no type hints: MLflow would validate by them
        """Open-loop prediction of the steps after the context, in raw observation units."""

        obs = torch.as_tensor(np.asarray(model_input["obs"], dtype=np.float32))
        action = torch.as_tensor(np.asarray(model_input["action"], dtype=np.float32))
        context_steps, total = obs.shape[1], action.shape[1]
        if total <= context_steps:
            raise ValueError(f"action has {total} steps; it needs more than the {context_steps} context steps")
        padded = torch.zeros(obs.shape[0], total, obs.shape[2], dtype=obs.dtype)
        padded[:, :context_steps] = obs  # steps after the context are never read
        with torch.no_grad():
            return predict_observations(self.model, padded, action, context_steps).numpy()


@dataclass(frozen=True)
class ModelRecord:
    """What the logged model is built from (passed in; this module reads no checkpoint)."""
    state_dict: Mapping[str, Any]
    model_config: Mapping[str, Any]
    obs_dim: int
    act_dim: int
    checkpoint_digest: str
    checkpoint_step: int
    example_obs: Any  # [n,C,O] raw, an input example
    example_action: Any  # [n,T,A]


def _signature(record: ModelRecord):

    inputs = Schema([TensorSpec(np.dtype("float32"), (-1, -1, record.obs_dim), "obs"),
                     TensorSpec(np.dtype("float32"), (-1, -1, record.act_dim), "action")])
    outputs = Schema([TensorSpec(np.dtype("float32"), (-1, -1, record.obs_dim))])
    return ModelSignature(inputs=inputs, outputs=outputs)


def _requirements() -> list[str]:

    return [f"{name}=={metadata.version(name)}" for name in ("worldpipe", "torch", "numpy", "hydra-core", "mlflow")]


def _find_logged(experiment_id: str, run_id: str, digest: str):
    found = mlflow.search_logged_models(
        experiment_ids=[experiment_id], output_format="list",
        filter_string=f"source_run_id = '{run_id}' AND tags.`{DIGEST_TAG}` = '{digest}'")
    return found[0] if found else None


def find_logged_model(uri: str, run_id: str, digest: str) -> str | None:
    """The id of the model logged from run ``run_id`` for checkpoint ``digest``, None if none was logged."""

    mlflow.set_tracking_uri(uri)
    logged = _find_logged(MlflowClient(uri).get_run(run_id).info.experiment_id, run_id, digest)
    return None if logged is None else logged.model_id


def log_world_model(uri: str, run_id: str, record: ModelRecord, register_as: str | None = None) -> str:
    """Log the model into run ``run_id`` (once per checkpoint digest), register it if asked; its model URI."""

    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = _find_logged(experiment_id, run_id, record.checkpoint_digest)
    if logged is None:
        tags = {DIGEST_TAG: record.checkpoint_digest, STEP_TAG: str(record.checkpoint_step)}
        with tempfile.TemporaryDirectory(prefix="worldpipe-model-") as tmp:
            weights, spec = Path(tmp) / "weights.pt", Path(tmp) / "spec.json"
            torch.save(dict(record.state_dict), weights)
            spec.write_text(json.dumps({"model": dict(record.model_config), "obs_dim": record.obs_dim,
                                        "act_dim": record.act_dim, "checkpoint_digest": record.checkpoint_digest,
                                        "checkpoint_step": record.checkpoint_step}, indent=1, sort_keys=True))
            example = {"obs": np.asarray(record.example_obs, dtype=np.float32),
                       "action": np.asarray(record.example_action, dtype=np.float32)}
            with mlflow.start_run(run_id=run_id, log_system_metrics=False):
                info = mlflow.pyfunc.log_model(
                    name=MODEL_NAME, python_model=str(MODEL_CODE),
                    artifacts={WEIGHTS: str(weights), SPEC: str(spec)}, signature=_signature(record),
                    input_example=example, pip_requirements=_requirements(), tags=tags, step=NO_RUN_METRICS_STEP)
        model_uri, model_id = info.model_uri, info.model_id
    else:
        model_uri, model_id = f"models:/{logged.model_id}", logged.model_id
    if register_as:
        register_version(client, register_as, model_uri, model_id, record.checkpoint_digest)
    return model_uri


def register_version(client, name: str, model_uri: str, model_id: str, digest: str) -> str:
    """The registered version of ``name`` holding checkpoint ``digest``, created if there is none yet."""

    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if getattr(err, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
    for version in client.search_model_versions(f"name = '{name}'"):
        if version.tags.get(DIGEST_TAG) == digest:
            return version.version
    version = client.create_model_version(name, model_uri, tags={DIGEST_TAG: digest}, model_id=model_id)
    return version.version

"""Datasets as MLflow run inputs: name, source (the store URL), digest (the dataset hash), array schema.

The UI's Datasets column then says which data a run saw. MLflow keeps at most 36 characters of a digest, so
the digest is a prefix of the dataset hash and the whole hash is in the dataset's profile.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worldpipe.core.locations import scheme

DIGEST_CHARS = 32  # MLflow's dataset digest column holds 36 characters
CONTEXT_TAG = "mlflow.data.context"  # the UI shows it beside the dataset name (training, evaluation, ...)
TRAINING, EVALUATION = "training", "evaluation"


@dataclass(frozen=True)
class DatasetRecord:
    """One dataset a run used, as its manifest describes it."""

    name: str
    store_url: str
    dataset_hash: str
    arrays: Mapping[str, Any]  # manifest "arrays": name -> {shape, dtype, ...}
    episodes: int | None = None
    steps: int | None = None
    context: str = TRAINING

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], store_url: str, context: str) -> DatasetRecord:
        """From a sealed dataset manifest and the URL its store was read from."""
        spec = manifest.get("spec") or {}
        return cls(name=str(spec.get("name") or "dataset"), store_url=str(store_url),
                   dataset_hash=str(manifest["dataset_hash"]), arrays=dict(manifest.get("arrays") or {}),
                   episodes=manifest.get("episodes"), steps=manifest.get("steps"), context=context)


def _schema(arrays: Mapping[str, Any]) -> str:
    """MLflow tensor schema of the stored arrays (leading episode dimension variable)."""
    import numpy as np
    from mlflow.types.schema import Schema, TensorSpec

    specs = []
    for name, info in sorted(arrays.items()):
        shape = [int(n) for n in info.get("shape", [])]
        specs.append(TensorSpec(np.dtype(info.get("dtype", "float32")), (-1, *shape[1:]), name))
    return json.dumps({"mlflow_tensorspec": {"features": Schema(specs).to_json(), "targets": None}})


def dataset_input(record: DatasetRecord):
    """The record as an ``mlflow.entities.DatasetInput`` tagged with its context."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    profile = json.dumps({"dataset_hash": record.dataset_hash, "episodes": record.episodes, "steps": record.steps})
    # The source in the form MLflow's own dataset sources use.
    dataset = Dataset(name=record.name, digest=record.dataset_hash[:DIGEST_CHARS],
                      source_type=scheme(record.store_url), source=json.dumps({"uri": record.store_url}),
                      schema=_schema(record.arrays), profile=profile)
    return DatasetInput(dataset=dataset, tags=[InputTag(key=CONTEXT_TAG, value=record.context)])


_INSERT_RACE_ATTEMPTS = 4


def log_datasets(client, run_id: str, records: list[DatasetRecord]) -> None:
    """Log the datasets as inputs of a run; one already logged (same name, digest, context) is not repeated."""
    def identity(entry) -> tuple:
        return entry.dataset.name, entry.dataset.digest, tuple(sorted((t.key, t.value) for t in entry.tags))

    run = client.get_run(run_id)
    present = {identity(d) for d in (run.inputs.dataset_inputs if run.inputs else [])}
    fresh = []
    for entry in map(dataset_input, records):
        if identity(entry) not in present:
            fresh.append(entry)
            present.add(identity(entry))
    if not fresh:
        return
    for attempt in range(_INSERT_RACE_ATTEMPTS):
        try:
            client.log_inputs(run_id, datasets=fresh)
            return
        except Exception as err:  # noqa: BLE001 - MLflow wraps the database's error in its own exception
            # Two processes logging the same dataset into one experiment at once (the pipeline's parallel
            # evaluations): MLflow's SQL store looks the dataset up, then inserts it, and the slower insert
            # fails on the unique key. Again, the lookup finds the row the other process made.
            if "unique constraint" not in str(err).lower() or attempt == _INSERT_RACE_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1))

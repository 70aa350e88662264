"""What a training run records besides metrics: params (every flattened config key, values too long for MLflow
stored as artifacts), identity tags and artifacts.

Artifact layout of a run (everything `worldpipe rerun` needs is here)::

    config.yaml                          resolved config of the latest segment (types exact)
    identity.json                        config hash, dataset hash, code version, versions, world size, numerics
                                         environment (also as tags worldpipe.numerics.*), ...
    hydra/{overrides,config,hydra}.yaml  Hydra's record of the command line (run_dir/hydra)
    dataset/manifest.json                the dataset manifest, including its generation spec
    environment/packages.txt             every installed distribution, `name==version`
    environment/requirements.lock        the lock file the install used
    code/git_diff.patch                  uncommitted changes (only when the tree was dirty)
    segments/start-NNNNNN.json           one per start/resume: step, world size, host, code, command line
    params_overflow/<key>.txt            param values longer than MLflow allows
    checkpoints/step-NNNNNN/
        MANIFEST.json                    the published checkpoint's manifest
        digest.json                      state digest + manifest sha256
        train_state.json                 progress and sampler state
        rng/rank-NNNNN.json              every rank's RNG state (readable JSON, exact: :func:`to_jsonable`)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from worldpipe.core import numerics
from worldpipe.core import provenance as ident
from worldpipe.core.hashing import only_json_scalars

# Metrics measured with a clock: they differ between bit-identical runs and are not compared by `rerun`.
TIMING_METRICS = ("samples_per_s", "step_time_s", "data_wait_s")
CHECKPOINT_ARTIFACT_DIR = "checkpoints"
RULE_ENV, JOB_ENV = "WORLDPIPE_RULE", "WORLDPIPE_JOB"
CHECKPOINT_STEP_TAG, CHECKPOINT_DIGEST_TAG = "worldpipe.checkpoint.step", "worldpipe.checkpoint.digest"
NUMERICS_TAG = "worldpipe.numerics"
NUMERICS_CHANGED_TAG = f"{NUMERICS_TAG}.changed"
# MLflow's server-side limit on a param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
MAX_PARAM_VALUE_LENGTH = 6000
OVERFLOW_ARTIFACT_DIR = "params_overflow"


def param_text(value: Any) -> str:
    """The string MLflow stores for a value (JSON for lists and null, so it reads back unambiguously)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def split_params(flat: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Split params into those that fit and overflow values; overflow params point at their artifact."""
    fitting: dict[str, str] = {}
    overflow: dict[str, str] = {}
    for key, value in flat.items():
        text = param_text(value)
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            overflow[key] = text
            fitting[key] = f"<artifact:{OVERFLOW_ARTIFACT_DIR}/{key}.txt>"
        else:
            fitting[key] = text
    return fitting, overflow


def run_tags(identity: Mapping[str, Any], start_step: int = 0) -> dict[str, str]:
    """Identity tags (searchable, shown in the UI); set at every start so they describe the latest segment."""
    code = identity["code_version"]
    versions = identity.get("versions", {})
    config = identity.get("config", {})
    layout = identity.get("parallel_layout", {})
    tags = {
        "worldpipe.version": str(code.get("worldpipe")),
        "worldpipe.git_sha": str(code.get("git_sha")),
        "worldpipe.git_dirty": str(code.get("git_dirty")),
        "worldpipe.dataset_hash": str(identity.get("dataset_hash")),
        "worldpipe.config_hash": str(identity.get("config_hash")),
        "worldpipe.lock_hash": str(identity.get("lock_hash")),
        "worldpipe.world_size": str(identity.get("world_size")),
        "worldpipe.strategy": str(layout.get("strategy")),
        "worldpipe.parallel_layout": json.dumps(layout, sort_keys=True),
        "worldpipe.seed": str(config.get("seed")),
        "worldpipe.host": ident.host(),
        "worldpipe.cwd": os.getcwd(),
        "worldpipe.run_dir": str(Path(config.get("run_dir", ".")).resolve()),
        "worldpipe.start_step": str(start_step),
        "worldpipe.timing_metrics": ",".join(TIMING_METRICS),
        "mlflow.source.type": "JOB",
        "mlflow.source.name": "worldpipe.trainer.main",
    }
    for name in ("python", "torch", "numpy"):
        tags[f"worldpipe.{name}_version"] = str(versions.get(name, platform.python_version() if name == "python" else None))
    if code.get("git_sha"):
        tags["mlflow.source.git.commit"] = str(code["git_sha"])
    if code.get("git_dirty"):
        tags["worldpipe.git_diff_sha256"] = hashlib.sha256(ident.git_diff().encode()).hexdigest()
    tags.update(numerics_tags(identity))
    for tag, variable in (("worldpipe.snakemake.rule", RULE_ENV), ("worldpipe.snakemake.job", JOB_ENV),
                          ("worldpipe.slurm_job_id", "SLURM_JOB_ID")):
        if os.environ.get(variable):
            tags[tag] = os.environ[variable]
    return tags


def numerics_tags(identity: Mapping[str, Any]) -> dict[str, str]:
    """``worldpipe.numerics.<field>`` for each field of the numerics environment, and
    ``worldpipe.numerics.changed`` naming every resume onto another environment (step and fields)."""
    tags = {f"{NUMERICS_TAG}.{key}": str(value)[:500]
            for key, value in (identity.get(numerics.IDENTITY_KEY) or {}).items()}
    changes = identity.get(numerics.CHANGES_KEY) or []
    if changes:
        tags[NUMERICS_CHANGED_TAG] = "; ".join(
            f"step {c['step']}: " + ", ".join(line.split(":", 1)[0] for line in c["fields"]) for c in changes)[:5000]
    return tags


def numerics_from_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The numerics environment :func:`numerics_tags` recorded on a run (empty when none was)."""
    start = NUMERICS_TAG + "."
    return {key[len(start):]: value for key, value in tags.items()
            if key.startswith(start) and key != NUMERICS_CHANGED_TAG}


def installed_packages() -> str:
    """`name==version` of every installed distribution (pip freeze without pip)."""
    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return "\n".join(seen[k] for k in sorted(seen)) + "\n"


def to_jsonable(obj: Any) -> Any:
    """Readable JSON of a state that holds tensors, arrays, tuples and big ints (sampler, RNG), exact to the bit:
    tensors become ``{"__tensor__": dtype, "shape": [...], "hex": bytes}``, NumPy arrays ``{"__ndarray__": dtype,
    "shape": [...], "data": [...]}``, tuples ``{"__tuple__": [...]}``, bytes ``{"__bytes__": hex}``."""
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported: no import here
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": raw.hex()}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes | bytearray):
        return {"__bytes__": bytes(obj).hex()}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        # Python's RNG state is a tuple of 625 ints: nothing in it to convert, so no call per item.
        items = list(obj) if only_json_scalars(obj) else [to_jsonable(v) for v in obj]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def json_artifact(obj: Any) -> bytes:
    """The JSON form of an artifact (indented, sorted keys, NumPy/torch values made plain)."""
    return (json.dumps(to_jsonable(obj), indent=1, sort_keys=True) + "\n").encode()


IDENTITY_ARTIFACT = "identity.json"  # the run's identity as of a start (config, data, code, layout, run id)


def start_artifacts(identity: Mapping[str, Any], manifest: Mapping[str, Any] | None, run_dir: str | os.PathLike,
                    start_step: int = 0) -> dict[str, bytes]:
    """Artifacts logged at every start (relative artifact path -> content)."""
    run_dir = Path(run_dir)
    files = {
        "config.yaml": yaml.safe_dump(identity["config"], sort_keys=False).encode(),
        IDENTITY_ARTIFACT: json_artifact(identity),
        "environment/packages.txt": installed_packages().encode(),
    }
    if manifest is not None:
        files["dataset/manifest.json"] = json_artifact(manifest)
    if ident.LOCK_FILE.exists():
        files["environment/requirements.lock"] = ident.LOCK_FILE.read_bytes()
    hydra_dir = run_dir / "hydra"
    if hydra_dir.is_dir():
        for path in sorted(hydra_dir.glob("*.yaml")):
            files[f"hydra/{path.name}"] = path.read_bytes()
    if identity["code_version"].get("git_dirty"):
        files["code/git_diff.patch"] = ident.git_diff().encode()
    segment = {
        "start_step": start_step, "world_size": identity.get("world_size"),
        "parallel_layout": identity.get("parallel_layout"), "code_version": identity["code_version"],
        "versions": identity.get("versions"), "host": ident.host(), "time_ms": int(time.time() * 1000),
        numerics.IDENTITY_KEY: identity.get(numerics.IDENTITY_KEY), "argv": sys.argv, "cwd": os.getcwd(),
        "snakemake": {"rule": os.environ.get(RULE_ENV), "job": os.environ.get(JOB_ENV)},
    }
    files[f"segments/start-{start_step:06d}.json"] = json_artifact(segment)
    return files


def checkpoint_artifacts(step_dir: str, digest_record: Mapping[str, Any], train_state: Mapping[str, Any],
                         files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Artifacts logged beside a published checkpoint, under ``checkpoints/<step_dir>/``.

    ``digest_record`` (step, state digest, manifest sha256, location) and ``train_state`` (progress, sampler)
    become JSON files; ``files`` (the manifest, every rank's RNG view) are logged as given. The caller reads
    them from the checkpoint: tracking logs what it is handed and reads no checkpoint itself.
    """
    base = f"{CHECKPOINT_ARTIFACT_DIR}/{step_dir}"
    artifacts = {f"{base}/digest.json": json_artifact(digest_record),
                 f"{base}/train_state.json": json_artifact(train_state)}
    artifacts.update({f"{base}/{name}": data for name, data in files.items()})
    return artifacts


def checkpoint_tags(step: int, digest: str | None) -> dict[str, str]:
    return {CHECKPOINT_STEP_TAG: str(step), CHECKPOINT_DIGEST_TAG: str(digest)}

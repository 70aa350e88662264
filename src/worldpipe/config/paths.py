"""Where results, data, runs and logs live, decided once in `conf/paths/default.yaml`.

Hydra composes that file as the `paths` group (training's `run_dir` derives from it); this module reads the same
file for the Snakefile and the CLI. Data and run directories are addressed by content:

    <data>/<dataset>/<spec-hash>/store.zarr, manifest.json      one directory per dataset spec
    <runs>/<experiment>/<run-hash>/                              one directory per resolved config + dataset
    <runs>/<experiment>/latest -> <run-hash>                     the run the pipeline started most recently

A changed spec or config is a new directory beside the old one; nothing is overwritten or deleted.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from worldpipe.core.provenance import PROJECT_ROOT

# Set by the Snakefile for the jobs it starts, so training composes the same conf/ tree the DAG was built from
# (a checkout other than the installed one, e.g. a copy under test).
CONF_DIR_ENV = "WORLDPIPE_CONF_DIR"
PATHS_FILE = Path("paths") / "default.yaml"
# Hex digits of a spec or run hash in a directory name: 48 bits, collisions are not a practical concern for
# the runs of one experiment.
HASH_CHARS = 12


def conf_dir() -> Path:
    """The Hydra config tree: $WORLDPIPE_CONF_DIR if set, else the checkout's `conf/`."""
    return Path(os.environ.get(CONF_DIR_ENV) or PROJECT_ROOT / "conf").resolve()


# The Hydra config tree of training runs (read once, at import: torchrun's workers inherit the variable).
CONF_DIR = conf_dir()


@functools.lru_cache(maxsize=8)
def _load(root: Path) -> dict[str, Any]:

    return OmegaConf.to_container(OmegaConf.load(root / PATHS_FILE), resolve=True)  # type: ignore[return-value]


def layout(root: Path | None = None) -> dict[str, Any]:
    """The resolved `paths` group (relative paths and file names), read from `root` (default: conf_dir())."""
    return _load(root or conf_dir())


_PATHS = layout(CONF_DIR)
# Written by rank 0 when a training run reaches its last step: final step, digest, MLflow run id.
COMPLETION_RECORD: str = _PATHS["completion_record"]
RUN_RECORD: str = _PATHS["run_record"]
# Appended by rank 0 at log cadence (one JSON line each): how far a running training is (worldpipe runs status).
PROGRESS_RECORD: str = _PATHS["progress"]
LATEST_LINK: str = _PATHS["latest"]
STORE_NAME: str = _PATHS["store"]
MANIFEST_NAME: str = _PATHS["manifest"]
# Where `worldpipe bench` writes its JSON and plots unless told otherwise (relative to the working directory).
BENCH_DIR: str = _PATHS["bench"]
# Inside a run directory: the checkpoint store and the evaluations.
CHECKPOINTS_DIR: str = _PATHS["checkpoints"]
EVAL_DIR: str = _PATHS["eval"]
CONTROL_DIR: str = _PATHS["control"]
LOSS_CURVE: str = _PATHS["loss_curve"]


def short(full_hash: str) -> str:
    """The prefix of a hash used in directory names."""
    return full_hash[:HASH_CHARS]


def dataset_dir(dataset: str, spec_hash: str, root: Path | None = None) -> str:
    """Directory of one dataset spec: `<data>/<dataset>/<spec-hash>`."""
    return f"{layout(root)['data']}/{dataset}/{short(spec_hash)}"


def experiment_dir(experiment: str, root: Path | None = None) -> str:
    """Directory holding every run of an experiment: `<runs>/<experiment>`."""
    return f"{layout(root)['runs']}/{experiment}"


def run_dir(experiment: str, run_hash: str, root: Path | None = None) -> str:
    """Directory of one run: `<runs>/<experiment>/<run-hash>`."""
    return f"{experiment_dir(experiment, root)}/{short(run_hash)}"


def default_tracking_uri(root: Path | None = None) -> str:
    """MLflow tracking URI used when none is configured: the SQLite file under the results directory."""
    return f"sqlite:///{Path(layout(root)['tracking_db']).resolve()}"


def checkpoints_dir(run_dir: str | os.PathLike) -> str:
    """The checkpoint store of a run directory (what ``checkpoint.dir`` defaults to)."""
    return f"{os.fspath(run_dir).rstrip('/')}/{CHECKPOINTS_DIR}"


def eval_dir(run_dir: str | os.PathLike, eval_hash: str | None = None) -> str:
    """A run's evaluation directory: ``<run_dir>/eval[/<eval-hash>]`` (a sweep point has a single one)."""
    base = f"{os.fspath(run_dir).rstrip('/')}/{EVAL_DIR}"
    return f"{base}/{short(eval_hash)}" if eval_hash else base


def sweep_dir(name: str, root: Path | None = None) -> str:
    """Directory of a sweep: ``<sweeps>/<name>`` (one run directory per point below it)."""
    return f"{layout(root)['sweeps']}/{name}"


def rounds_dir(rounds_id: str, root: Path | None = None) -> str:
    """Directory of a collect-train loop's summary: ``<rounds>/<rounds-id>`` (its runs live under runs/)."""
    return f"{layout(root)['rounds']}/{rounds_id}"

"""Shared fixtures: the repository root, the venv's executables, small real datasets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_with_venv() -> dict[str, str]:
    """Environment whose PATH starts with this interpreter's bin (worldpipe, torchrun, snakemake)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["SDL_VIDEODRIVER"] = "dummy"
    return env


@pytest.fixture(scope="session")
def smoke_dataset(tmp_path_factory, env_with_venv) -> tuple[Path, Path]:
    """A real 24-episode Pendulum store + manifest, built once per session through the CLI."""
    from datasets import build_dataset

    return build_dataset(tmp_path_factory.mktemp("smoke_data"), env_with_venv)

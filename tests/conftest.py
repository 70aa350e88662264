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

"""Shared fixtures: the repository root, the venv's executables, small real datasets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-skips", action="store_true",
                     help="a test that would skip fails instead: every tier selected must really run (make test)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under --no-skips a skip (a cluster, server or tool that could not be brought up) is a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.config.getoption("--no-skips") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under --no-skips (this tier must run here): {reason}"


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


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    """URL of a real S3-compatible server (moto's server mode) on 127.0.0.1, for s3fs-based tests."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed")
    pytest.importorskip("s3fs", reason="s3fs not installed")
    try:
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except OSError as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"cannot start a moto S3 server on 127.0.0.1: {exc}")
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()

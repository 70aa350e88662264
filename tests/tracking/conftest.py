"""Fixtures shared by the unit tests of the tracking recorder and its spool."""

import socket

import pytest
from mlflow.tracking import MlflowClient


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """An embedded SQLite MLflow store, its schema created once for the module."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


@pytest.fixture
def dead_uri() -> str:
    """An HTTP tracking URI on a free local port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"

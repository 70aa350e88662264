"""A new SQLite tracking store appears whole: a creator killed (SIGKILL) while MLflow makes its tables leaves no
store, only a scratch file that the next creator removes; a store that exists is left as it is.

Real MLflow, a real SQLite file, a real SIGKILL of a process creating the store.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from worldpipe.tracking.connection import SCRATCH_STORE, create_sqlite_store

pytestmark = pytest.mark.slow  # imports MLflow in a child process: seconds

CREATE = "import sys; from pathlib import Path; from worldpipe.tracking.connection import create_sqlite_store; " \
         "create_sqlite_store(Path(sys.argv[1]))"


def test_a_creator_killed_midway_leaves_no_store_and_the_next_one_makes_it_whole(tmp_path, env_with_venv):
    store = tmp_path / "mlflow.db"
    proc = subprocess.Popen([sys.executable, "-c", CREATE, str(store)], env=env_with_venv)
    scratch = tmp_path / SCRATCH_STORE.format(name=store.name, pid=proc.pid)
    deadline = time.monotonic() + 120
    while not (scratch.exists() and scratch.stat().st_size > 0) and time.monotonic() < deadline:
        assert proc.poll() is None, "the creator ended before its scratch store held anything"
        time.sleep(0.002)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not store.exists() and scratch.exists()  # killed while MLflow was making the tables

    create_sqlite_store(store)
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name]  # the dead creator's scratch file is gone
    assert [e.name for e in MlflowClient(f"sqlite:///{store}").search_experiments()] == ["Default"]


def test_an_existing_store_is_left_as_it_is(tmp_path):
    store = tmp_path / "mlflow.db"
    create_sqlite_store(store)
    MlflowClient(f"sqlite:///{store}").create_experiment("kept")
    before = store.read_bytes()
    create_sqlite_store(store)
    assert store.read_bytes() == before
    assert "kept" in {e.name for e in MlflowClient(f"sqlite:///{store}").search_experiments()}


def test_the_store_is_made_in_a_missing_directory(tmp_path):
    store = tmp_path / "results" / "mlflow.db"
    create_sqlite_store(store)
    assert store.is_file() and [p.name for p in store.parent.iterdir()] == [store.name]

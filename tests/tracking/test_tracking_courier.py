"""The courier's edges: one started early gives up on a dead server in seconds, one killed mid-run is replaced by
delivery in this process at the end, and where no child process can start the recorder delivers in this process
from the start. (Its ordinary life, warnings and abandonment: the spool's and the background start's tests.) A
real MLflow SQLite backend; an unreachable server is a 127.0.0.1 port nothing listens on; the courier is a real
child process, killed by its PID."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from test_tracking_background_start import train  # the training loop's recorder calls, as there

from worldpipe.tracking.connection import HTTP_DEFAULTS
from worldpipe.tracking.courier import start_early
from worldpipe.tracking.history import histories
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.spool import Spool


@pytest.mark.slow  # a courier imports MLflow in a fresh interpreter (seconds on a busy 2-core machine)
def test_a_courier_started_early_gives_up_on_a_dead_server_in_seconds(tmp_path, dead_uri, caplog, monkeypatch):
    # A one-process launcher starts the courier before any recorder exists: MLflow's own retry policy (minutes
    # against a dead server) must not be what the courier inherits.
    for key in HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    start_early(tmp_path, dead_uri, 0.0, 1)
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = RunRecorder(True, dead_uri, "courier-early-offline", run_dir=tmp_path)
        recorder.start(None, "early", {})
        began = time.monotonic()
        assert recorder.await_run_id() is None
        waited = time.monotonic() - began
        recorder.end()
    messages = [r.getMessage() for r in caplog.records]
    assert waited < 30 and not any("still in progress" in m for m in messages), (waited, messages)
    assert sum("is unreachable" in m for m in messages) == 1, messages


@pytest.mark.slow
def test_a_killed_courier_is_replaced_by_delivery_in_this_process_at_the_end(tmp_path, sqlite_uri, caplog):
    recorder = RunRecorder(True, sqlite_uri, "courier-killed", run_dir=tmp_path)
    recorder.start(None, "killed", {})
    run_id = recorder.await_run_id()
    os.kill(recorder.courier_pid, signal.SIGKILL)
    train(recorder, range(1, 21))  # wake-ups into a dead courier's pipe: never an error here
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder.end()
    assert any("is gone; delivering in this process" in r.getMessage() for r in caplog.records)
    client = MlflowClient(sqlite_uri)
    assert [s for s, _, _ in histories(client, run_id)["lr"]] == list(range(1, 21))
    assert client.get_run(run_id).info.status == "FINISHED" and not Spool(tmp_path).pending()


def test_without_a_child_process_the_recorder_delivers_in_this_process(tmp_path, sqlite_uri, monkeypatch, caplog):
    # Where no process can be started (here: no interpreter where sys.executable says), delivery falls back to
    # this process, synchronously: the run exists when start returns, and records arrive as they are appended.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = RunRecorder(True, sqlite_uri, "courier-fallback", run_dir=tmp_path)
        run_id = recorder.start(None, "fallback", {})
    assert any("could not be started" in r.getMessage() for r in caplog.records)
    assert recorder.courier_pid is None and run_id is not None
    recorder.log_params({"seed": 0})
    train(recorder, range(1, 21))
    assert not Spool(tmp_path).pending()
    recorder.end()
    client = MlflowClient(sqlite_uri)
    assert [s for s, _, _ in histories(client, run_id)["lr"]] == list(range(1, 21))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"seed": "0"}

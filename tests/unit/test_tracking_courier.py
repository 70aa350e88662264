"""The recorder with a courier process (what the trainer uses): the records reach MLflow as from the in-process
delivery thread, the courier's warnings read in this process's log, and the courier never outlives its segment,
whether it is ended, abandoned, or killed. A real MLflow SQLite backend; an unreachable server is a 127.0.0.1
port nothing listens on; the courier is a real child process, checked and killed by its PID."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient
from test_tracking_background_start import train  # the training loop's recorder calls, as there

from processes import wait_gone
from worldpipe.cli import main as cli_main
from worldpipe.tracking.courier import HTTP_DEFAULTS, RECORD_NAME, start_early
from worldpipe.tracking.history import duplicate_steps, histories
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX

# Each test starts a courier, which imports MLflow in a fresh interpreter (seconds on a busy 2-core machine).
pytestmark = pytest.mark.slow


def courier(uri: str, experiment: str, run_dir, **kwargs) -> RunRecorder:
    return RunRecorder(True, uri, experiment, run_dir=run_dir, background_start=True, courier=True, **kwargs)


def test_a_courier_delivers_the_segment_and_is_reaped(tmp_path, sqlite_uri):
    opened = []
    recorder = courier(sqlite_uri, "courier-one-run", tmp_path, system_metrics_s=0.2,
                       on_opened=lambda: opened.append(True))
    torch_loaded = "torch" in sys.modules  # depends on what else this worker ran
    recorder.start(None, "courier", {"worldpipe.seed": "0"})
    pid = recorder.courier_pid
    record = json.loads((tmp_path / "tracking" / RECORD_NAME).read_text())
    assert record == {"pid": pid, "parent_pid": os.getpid(), "before_torch": not torch_loaded}
    child = psutil.Process(pid)
    assert child.ppid() == os.getpid() and os.getpgid(pid) == os.getpgid(0)  # our child, in our process group
    recorder.log_params({"trainer.steps": 40, "seed": 0})
    train(recorder, range(1, 41))
    run_id = recorder.await_run_id()
    assert run_id is not None
    recorder.end()
    assert opened == [True]  # reported once, after the start was tried (await_run_id may return first)
    assert not wait_gone({pid}, timeout=0) and not (tmp_path / "tracking" / RECORD_NAME).exists()

    client = MlflowClient(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"trainer.steps": "40", "seed": "0"}
    assert run.data.tags["worldpipe.checkpoint.step"] == "40"
    history = histories(client, run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 41)) and not duplicate_steps(history)
    assert len(client.list_artifacts(run_id, "checkpoints")) == 4
    assert any(key.startswith(SYSTEM_PREFIX) for key in run.data.metrics), sorted(run.data.metrics)
    assert not Spool(tmp_path).pending()


def test_the_couriers_warning_is_logged_here_once_and_sync_replays(tmp_path, dead_uri, sqlite_uri, caplog):
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = courier(dead_uri, "courier-offline", tmp_path)
        recorder.start(None, "offline", {})
        recorder.log_params({"seed": 0})
        assert recorder.await_run_id() is None  # tried: the courier met the dead server
        train(recorder, range(1, 21))
        recorder.end()
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and "worldpipe tracking sync" in unreachable[0].getMessage()
    assert unreachable[0].name == "worldpipe.tracking"
    assert any("still spooled" in r.getMessage() for r in caplog.records)
    assert Spool(tmp_path).pending()

    assert cli_main(["tracking", "sync", str(tmp_path), "--tracking-uri", sqlite_uri]) == 0
    [run] = MlflowClient(sqlite_uri).search_runs(
        [MlflowClient(sqlite_uri).get_experiment_by_name("courier-offline").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"seed": "0"}


def test_a_courier_started_early_gives_up_on_a_dead_server_in_seconds(tmp_path, dead_uri, caplog, monkeypatch):
    # A one-process launcher starts the courier before any recorder exists: MLflow's own retry policy (minutes
    # against a dead server) must not be what the courier inherits.
    for key in HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    start_early(tmp_path, dead_uri, 0.0, 1)
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = courier(dead_uri, "courier-early-offline", tmp_path)
        recorder.start(None, "early", {})
        began = time.monotonic()
        assert recorder.await_run_id() is None
        waited = time.monotonic() - began
        recorder.end()
    messages = [r.getMessage() for r in caplog.records]
    assert waited < 30 and not any("still in progress" in m for m in messages), (waited, messages)
    assert sum("is unreachable" in m for m in messages) == 1, messages


def test_a_synchronous_start_returns_the_run_id(tmp_path, sqlite_uri):
    recorder = RunRecorder(True, sqlite_uri, "courier-sync", run_dir=tmp_path, courier=True)
    run_id = recorder.start(None, "sync", {})
    assert run_id is not None and run_id == Spool(tmp_path).state()["run_id"]
    recorder.end()
    assert MlflowClient(sqlite_uri).get_run(run_id).info.status == "FINISHED"


def test_an_abandoned_courier_exits_and_the_next_segment_delivers_everything(tmp_path, sqlite_uri):
    first = courier(sqlite_uri, "courier-abandoned", tmp_path)
    run_id = first.start(None, "abandoned", {}) or first.await_run_id()
    pid = first.courier_pid
    train(first, range(1, 24))  # checkpoints 10 and 20 journaled; 21..23 only in memory
    first._stop_thread()  # this process "died": the control pipe is closed, the courier must go
    assert not wait_gone({pid})
    first.spool.release_active()

    resumed = courier(sqlite_uri, "courier-abandoned", tmp_path)
    resumed.start(run_id, "abandoned", {}, resume_step=20)
    train(resumed, range(21, 41))
    resumed.end()
    client = MlflowClient(sqlite_uri)
    history = histories(client, run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 41)) and not duplicate_steps(history)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_killed_courier_is_replaced_by_delivery_in_this_process_at_the_end(tmp_path, sqlite_uri, caplog):
    recorder = courier(sqlite_uri, "courier-killed", tmp_path)
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

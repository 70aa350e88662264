"""Tracking's delivery out of the training process (issue 41): with tracking on, a `worldpipe train` process never
imports MLflow (the courier, its child process, does), every record still arrives, and a `kill -9` of the
training process leaves no courier behind.

Real single-process trainings (in the `worldpipe train` process itself) and one on two ranks under torchrun, a
real MLflow SQLite store, a real SIGKILL of the training process alone (not its process group: the courier must
notice by itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from processes import wait_gone
from worldpipe.tracking.courier import RECORD_NAME
from worldpipe.tracking.history import duplicate_steps, histories
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, EVERY, LOG_EVERY = 20, 10, 5

# `worldpipe train` in this interpreter, then the MLflow modules it holds (the console script is this call).
TRAIN_AND_LIST_MLFLOW = """
import json, sys
from worldpipe.cli import main
code = main(sys.argv[1:])
print("MLFLOW_MODULES " + json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] == "mlflow")))
sys.exit(code)
"""


def train_args(run_dir: Path, dataset, db: Path, *extra: str) -> list[str]:
    store, manifest = dataset
    return ["train", "experiment=smoke", "parallel=single", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", f"tracking.uri=sqlite:///{db}", "trainer.progress_bar=false", *extra]


def test_the_training_process_never_imports_mlflow_and_every_record_arrives(tmp_path, smoke_dataset,
                                                                            env_with_venv):
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    args = train_args(run_dir, smoke_dataset, db, f"trainer.steps={STEPS}", f"checkpoint.every={EVERY}",
                      f"trainer.log_every={LOG_EVERY}", "tracking.system_metrics_interval_s=0.5")
    proc = subprocess.run([sys.executable, "-c", TRAIN_AND_LIST_MLFLOW, *args], env=env_with_venv, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("MLFLOW_MODULES ")]
    assert json.loads(line.split(" ", 1)[1]) == [], "the training process imported MLflow"

    client = MlflowClient(f"sqlite:///{db}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    done = json.loads((run_dir / "train_done.json").read_text())
    assert run.info.status == "FINISHED" and done["mlflow_run_id"] == run.info.run_id
    history = histories(client, run.info.run_id)
    assert [s for s, _, _ in history["loss/total"]] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert not duplicate_steps(history)
    assert any(key.startswith(SYSTEM_PREFIX) for key in run.data.metrics), sorted(run.data.metrics)
    assert run.data.params and not Spool(run_dir).pending()
    assert not (run_dir / "tracking" / RECORD_NAME).exists()  # the courier was stopped and reaped


def test_under_torchrun_rank_0_starts_the_courier_ahead_and_every_record_arrives(tmp_path, smoke_dataset,
                                                                                env_with_venv):
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    args = train_args(run_dir, smoke_dataset, db, "parallel.nproc_per_node=2")
    args.remove("parallel=single")
    train = subprocess.Popen([sys.executable, "-m", "worldpipe.cli", *args], env=env_with_venv, cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    record, seen = run_dir / "tracking" / RECORD_NAME, {}
    try:
        deadline = time.monotonic() + 300
        while train.poll() is None and time.monotonic() < deadline:  # every courier the run starts, by PID
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                courier = json.loads(record.read_text())
                if courier["pid"] not in seen:
                    seen[courier["pid"]] = courier
                    with contextlib.suppress(psutil.NoSuchProcess):  # rank 0's worker, unless already finished
                        assert psutil.Process(courier["parent_pid"]).environ().get("RANK") == "0"
            time.sleep(0.02)
        _, stderr = train.communicate(timeout=600)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait()
    assert train.returncode == 0, stderr[-3000:]
    # One courier, started by rank 0's worker before it imported torch and adopted by its recorder (a recorder
    # that does not adopt it starts a second one, after torch).
    assert [courier["before_torch"] for courier in seen.values()] == [True], seen
    client = MlflowClient(f"sqlite:///{db}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"] == run.info.run_id
    assert [s for s, _, _ in histories(client, run.info.run_id)["loss/total"]] == list(range(5, 41, 5))
    assert not record.exists()  # stopped and reaped


def test_async_checkpoints_are_recorded_with_their_manifests(tmp_path, smoke_dataset, env_with_venv):
    """Every checkpoint's records name its manifest, async ones too: they are recorded once durable, not when
    the save call returns (the manifest is written by the background publication)."""
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    args = train_args(run_dir, smoke_dataset, db, "trainer.steps=30", "checkpoint.every=10",
                      "checkpoint.async_save=true", "checkpoint.keep_last=5")
    proc = subprocess.run([sys.executable, "-m", "worldpipe.cli", *args], env=env_with_venv, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{db}")
    run_id = json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"]
    for step in (10, 20, 30):
        base = f"checkpoints/step-{step:06d}"
        names = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, base)}
        assert {"MANIFEST.json", "digest.json", "train_state.json", "rng"} <= names, (step, names)
        on_disk = (run_dir / base / "MANIFEST.json").read_bytes()
        record = json.loads(Path(client.download_artifacts(run_id, f"{base}/digest.json", str(tmp_path))).read_text())
        assert record["manifest_sha256"] == hashlib.sha256(on_disk).hexdigest(), step


def test_kill9_of_the_training_process_leaves_no_courier(tmp_path, smoke_dataset, env_with_venv):
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    args = train_args(run_dir, smoke_dataset, db, "trainer.steps=1000000", "checkpoint.every=1000000")
    train = subprocess.Popen([sys.executable, "-c", TRAIN_AND_LIST_MLFLOW, *args], env=env_with_venv,
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = run_dir / "tracking" / RECORD_NAME
    try:
        deadline = time.monotonic() + 300
        # Kill it once the courier has opened the run: it is then idle between deliveries, as for most of a run.
        while not (record.exists() and Spool(run_dir).state()["run_id"]):
            assert train.poll() is None, "the training ended before its courier opened the run"
            assert time.monotonic() < deadline, "the courier never opened the run"
            time.sleep(0.2)
        courier = json.loads(record.read_text())
        assert courier["parent_pid"] == train.pid
        child = psutil.Process(courier["pid"])
        assert child.ppid() == train.pid and os.getpgid(child.pid) == os.getpgid(train.pid)
        train.send_signal(signal.SIGKILL)  # the training process alone
        assert train.wait(60) == -signal.SIGKILL
        assert not wait_gone({courier["pid"]}, timeout=30), "the courier outlived the training process"
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()

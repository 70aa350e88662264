"""kill -9 with tracking on: the resumed run continues the same MLflow run, and its metric history ends equal
to an uninterrupted run's (every key, step and value except timing metrics), with no duplicate steps.

Real torchrun (2 gloo ranks), a real MLflow SQLite store written by the training processes, real SIGKILL of
the whole process group at a random point after the first checkpoint (the kill is proven to have landed).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kill_support import kill_at_random_point
from tracked_runs import LOG_EVERY, STEPS, only_run, train_cmd
from worldpipe.tracking.history import duplicate_steps, first_difference, histories
from worldpipe.tracking.records import TIMING_METRICS

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

@pytest.fixture(scope="module")
def reference(tmp_path_factory, smoke_dataset, env_with_venv):
    root = tmp_path_factory.mktemp("tracked_reference")
    proc = subprocess.run(train_cmd(root / "run", smoke_dataset, root / "mlflow" / "mlflow.db"), env=env_with_venv,
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, run = only_run(root / "mlflow" / "mlflow.db")
    return histories(client, run.info.run_id)


def test_kill9_with_tracking_resumes_into_one_run_with_the_uninterrupted_history(
        tmp_path, smoke_dataset, env_with_venv, reference):
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    cmd = train_cmd(run_dir, smoke_dataset, db)
    kill = kill_at_random_point(cmd, run_dir, env_with_venv, seed=5, final_step=STEPS, clean=(db.parent,))
    print(f"kill landed after step {kill.step} (attempt {kill.attempts})")
    resumed = subprocess.run(cmd, env=env_with_venv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    client, run = only_run(db)
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"] == run.info.run_id
    got = histories(client, run.info.run_id)
    assert duplicate_steps(got) == {}
    assert set(got) == set(reference)
    assert {m for m in reference if m.startswith("loss/")} >= {"loss/total", "loss/recon", "loss/kl"}
    for key in TIMING_METRICS:  # timing values differ run to run, but their steps must not
        assert [p[0] for p in got[key]] == [p[0] for p in reference[key]], key
    assert first_difference(got, reference, ignore=TIMING_METRICS) is None
    assert [p[0] for p in got["loss/total"]] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))

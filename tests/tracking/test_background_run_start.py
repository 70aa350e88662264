"""A single-process `worldpipe train` starts its MLflow run in the background (issue 12, start-up): the run id
still reaches every checkpoint, the completion record and the run's own identity artifact; the checkpoint digest
does not depend on tracking; a run killed (SIGKILL, by the checkpoint fault hook) before its run start ever
succeeded resumes into ONE MLflow run whose history equals an uninterrupted run's.

Real in-process training runs, a real MLflow SQLite store, an unreachable server on a 127.0.0.1 port nothing
listens on, a real SIGKILL.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from worldpipe.tracking.history import duplicate_steps, first_difference, histories, read_artifact
from worldpipe.tracking.records import CHECKPOINT_DIGEST_TAG, TIMING_METRICS
from worldpipe.tracking.spool import Spool

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, EVERY, LOG_EVERY = 40, 10, 5


def train(run_dir: Path, dataset, env: dict, uri: str | None, *extra: str) -> subprocess.CompletedProcess:
    store, manifest = dataset
    tracking = [f"tracking.uri={uri}"] if uri else ["tracking.enabled=false"]
    cmd = ["worldpipe", "train", "experiment=smoke", "parallel=single", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", "trainer.progress_bar=false", f"trainer.steps={STEPS}",
           f"checkpoint.every={EVERY}", f"trainer.log_every={LOG_EVERY}", *tracking, *extra]
    return subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)


def only_run(db: Path):
    client = MlflowClient(f"sqlite:///{db}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def done_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "train_done.json").read_text())


def checkpoint_run_ids(run_dir: Path) -> dict[str, str | None]:
    return {step.name: json.loads((step / "identity.json").read_text())["mlflow_run_id"]
            for step in sorted((run_dir / "checkpoints").glob("step-*"))}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, smoke_dataset, env_with_venv) -> dict:
    root = tmp_path_factory.mktemp("background_start")
    db = root / "mlflow" / "mlflow.db"
    proc = train(root / "run", smoke_dataset, env_with_venv, f"sqlite:///{db}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, run = only_run(db)
    return {"run_dir": root / "run", "client": client, "run": run, "history": histories(client, run.info.run_id)}


def test_the_run_id_reaches_checkpoints_completion_record_and_identity_artifact(tracked):
    client, run, run_dir = tracked["client"], tracked["run"], tracked["run_dir"]
    run_id, done = run.info.run_id, done_record(tracked["run_dir"])
    assert run.info.status == "FINISHED" and done["mlflow_run_id"] == run_id
    # No save waits for the run start but the final one: an earlier checkpoint names the run, or none if it was
    # written before the start was acknowledged (a resume from it reopens the run its spool names).
    ids = checkpoint_run_ids(run_dir)
    assert ids[f"step-{STEPS:06d}"] == run_id and set(ids.values()) <= {run_id, None}, ids
    assert json.loads(read_artifact(client, run_id, "identity.json"))["mlflow_run_id"] == run_id
    assert run.data.tags[CHECKPOINT_DIGEST_TAG] == done["digest"]
    history = tracked["history"]
    assert [s for s, _, _ in history["loss/total"]] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert not duplicate_steps(history)
    assert not Spool(run_dir).pending()


def test_the_digest_does_not_depend_on_tracking(tracked, tmp_path, smoke_dataset, env_with_venv):
    proc = train(tmp_path / "untracked", smoke_dataset, env_with_venv, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done_record(tmp_path / "untracked")["digest"] == done_record(tracked["run_dir"])["digest"]


def test_killed_before_the_run_start_succeeded_resumes_into_one_run(tracked, tmp_path, smoke_dataset,
                                                                   env_with_venv):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens: the run start cannot succeed
    run_dir, db = tmp_path / "run", tmp_path / "mlflow" / "mlflow.db"
    # Killed in the final save: the only one that waits for the run start to have been tried, so the warning has
    # been said by then (a kill at an earlier save raced the courier's first attempt).
    killed = train(run_dir, smoke_dataset, {**env_with_venv, "WORLDPIPE_CKPT_FAULT": f"before_files@{STEPS}:die"},
                   dead)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "is unreachable" in killed.stderr and "Traceback" not in killed.stderr
    resume_step = STEPS - EVERY
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{resume_step:06d}"
    assert set(checkpoint_run_ids(run_dir).values()) == {None}
    assert Spool(run_dir).state()["run_id"] is None and Spool(run_dir).pending()

    resumed = train(run_dir, smoke_dataset, env_with_venv, f"sqlite:///{db}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, run = only_run(db)
    assert run.info.status == "FINISHED" and done_record(run_dir)["mlflow_run_id"] == run.info.run_id
    got = histories(client, run.info.run_id)
    assert duplicate_steps(got) == {}
    assert first_difference(got, tracked["history"], ignore=TIMING_METRICS) is None
    steps = sorted(a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert steps == [f"step-{s:06d}" for s in range(EVERY, STEPS + 1, EVERY)]
    assert {f"segments/start-{s:06d}.json" for s in (0, resume_step)} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "segments")}

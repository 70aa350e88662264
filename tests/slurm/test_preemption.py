"""Preempt training on a real cluster, twice, through both paths a cluster takes, and end bit-identical to an
uninterrupted run, in the same MLflow run:

1. the warning signal (`scancel --signal=USR1`, what `sbatch --signal=USR1@N` sends N seconds before the time
   limit) reaches the training job step: training checkpoints and exits 75, the job fails, Snakemake resubmits
   it (profile `retries`) and the new job resumes;
2. `scontrol requeue` (what PreemptMode=REQUEUE does): SLURM sends SIGTERM to the whole job, training
   checkpoints within KillWait, and SLURM requeues the same job id, whose rerun resumes.
"""

from __future__ import annotations

import json
import re
import subprocess
from signal import SIGTERM, SIGUSR1

import pytest
from localslurm import job_field, job_state, run, wait_for
from pipeline_runs import (
    RUN_DIR,
    SLURM_ARGS,
    SMOKE,
    TRAIN_DONE,
    digest,
    failure_report,
    latest_step,
    overlay_config,
    slurm_jobs,
    smoke_dataset,
    smoke_target,
    start_snakemake,
    train_log,
)

from pipeline_project import seed_datasets

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS, EVERY = 600, 50  # long enough (~30 s of steps here) to be interrupted twice
TRAIN = {"nproc_per_node": 2, "nnodes": 1, "overrides": [f"trainer.steps={STEPS}", f"checkpoint.every={EVERY}"]}


def preempted_record(run_dir, after_step: int = 0) -> dict | None:
    """The PREEMPTED record training writes on a preemption signal, if it is newer than `after_step`."""
    try:
        record = json.loads((run_dir / "PREEMPTED").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if record["final_step"] > after_step else None


def running_train_job(exclude: set[str]) -> str | None:
    for job_id, state in slurm_jobs("train_model"):
        if job_id not in exclude and state == "RUNNING":
            return job_id
    return None


@pytest.fixture(scope="module")
def preempted_run(slurm_cluster, env_with_venv, tmp_path_factory, workstation_smoke):
    """Training through the pipeline (on datasets made earlier), preempted once by the warning signal and once
    by a requeue."""
    workdir = tmp_path_factory.mktemp("preempted")
    seed_datasets(workstation_smoke[0], workdir)
    overlay = overlay_config(workdir / "long.yaml", train=TRAIN)
    run_dir = workdir / RUN_DIR
    proc = start_snakemake(workdir, env_with_venv, [SMOKE, overlay], *SLURM_ARGS, smoke_target([SMOKE, overlay]))
    events = {}
    try:
        # 1. warning signal, once the first checkpoint is published
        first = wait_for(lambda: running_train_job(set()), 600, "the training job to run")
        wait_for(lambda: latest_step(run_dir) >= EVERY, 300, "the first checkpoint")
        run(["scancel", "--signal=USR1", first])
        events["signal"] = wait_for(lambda: preempted_record(run_dir), 180, "training to stop on the signal")
        wait_for(lambda: job_state(first) == "FAILED", 180, f"job {first} to fail (training exited 75)")

        # 2. requeue of the resubmitted job, once it has published a checkpoint of its own
        second = wait_for(lambda: running_train_job({first}), 600, "Snakemake to resubmit the training job")
        signal_step = events["signal"]["final_step"]
        wait_for(lambda: latest_step(run_dir) > signal_step, 300, "a checkpoint after the resume")
        run(["scontrol", "requeue", second])
        events["requeue"] = wait_for(lambda: preempted_record(run_dir, signal_step), 180,
                                     "training to stop on the requeue's SIGTERM")
        # SLURM holds a requeued job for ~2 minutes (BeginTime); release it now.
        wait_for(lambda: job_state(second) == "PENDING", 180, f"job {second} to be requeued")
        run(["scontrol", "update", f"JobId={second}", "StartTime=now"])

        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.terminate()  # Snakemake cancels its SLURM jobs
            proc.wait(timeout=120)
    output = (workdir / "snakemake.out").read_text()
    assert proc.returncode == 0, failure_report(output, workdir, slurm_cluster)
    events["restarts"] = job_field(second, "Restarts")
    events["final_state"] = job_state(second)
    return workdir, events


@pytest.fixture(scope="module")
def uninterrupted(preempted_run, env_with_venv):
    """The same training, uninterrupted, on this machine (same command as the rule, same data)."""
    workdir, _ = preempted_run
    ref = workdir / "reference"
    ref.mkdir()
    subprocess.run(
        ["worldpipe", "train", "experiment=smoke", f"run_dir={ref}",
         f"data.store={smoke_dataset(workdir)}/store.zarr",
         f"data.manifest={smoke_dataset(workdir)}/manifest.json",
         "parallel.nproc_per_node=2", "parallel.nnodes=1", f"tracking.uri=sqlite:///{ref}/mlflow.db",
         "trainer.progress_bar=false", *TRAIN["overrides"]],
        env=env_with_venv, check=True, capture_output=True, timeout=600, cwd=ref,  # MLflow artifacts: ./mlruns
    )
    return ref


def test_both_interruptions_checkpointed_and_resumed(preempted_run):
    workdir, events = preempted_run
    signal_step, requeue_step = events["signal"]["final_step"], events["requeue"]["final_step"]
    assert 0 < signal_step < requeue_step < STEPS
    assert events["restarts"] == "1"  # the requeued job ran again under the same id
    assert events["final_state"] == "COMPLETED"
    assert not (workdir / RUN_DIR / "PREEMPTED").exists()
    # Snakemake empties a rule's log when it starts the rule again: the last attempt's log remains.
    log = train_log(workdir).read_text(errors="replace")
    run_hash = (workdir / RUN_DIR).resolve().name
    assert f"resumed from results/runs/smoke/{run_hash}/checkpoints step {requeue_step} " in log, log[-3000:]
    # the failed first job's log, shown by Snakemake (show-failed-logs)
    shown = (workdir / "snakemake.out").read_text(errors="replace")
    assert re.search(rf"preempted by signal ({int(SIGUSR1)}|{int(SIGTERM)}): checkpoint at step {signal_step} published", shown)


def test_resumed_run_ends_with_the_uninterrupted_digest(preempted_run, uninterrupted, env_with_venv):
    workdir, _ = preempted_run
    record = json.loads((workdir / TRAIN_DONE).read_text())
    assert record["final_step"] == STEPS
    assert digest(workdir / RUN_DIR, env_with_venv) == digest(uninterrupted, env_with_venv)


def test_mlflow_run_continued(preempted_run, uninterrupted):
    from mlflow.tracking import MlflowClient

    workdir, events = preempted_run
    record = json.loads((workdir / TRAIN_DONE).read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/results/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("worldpipe").experiment_id])
    assert [r.info.run_id for r in runs] == [record["mlflow_run_id"]]
    assert events["signal"]["mlflow_run_id"] == events["requeue"]["mlflow_run_id"] == record["mlflow_run_id"]
    assert runs[0].info.status == "FINISHED"
    ref_client = MlflowClient(tracking_uri=f"sqlite:///{uninterrupted}/mlflow.db")
    ref_run = json.loads((uninterrupted / "train_done.json").read_text())["mlflow_run_id"]
    history = [(m.step, m.value) for m in client.get_metric_history(record["mlflow_run_id"], "loss/total")]
    expected = [(m.step, m.value) for m in ref_client.get_metric_history(ref_run, "loss/total")]
    assert sorted(history) == sorted(expected)

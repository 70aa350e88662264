"""The tiny pipeline through the SLURM profile on a real one-node cluster: every rule a SLURM job, training a
job step of its own, and the same checkpoint digest as the same config trained on the workstation."""

from __future__ import annotations

import json
import re

import pytest
from pipeline_runs import (
    RUN_DIR,
    SLURM_ARGS,
    SMOKE,
    digest,
    failure_report,
    run_snakemake,
    slurm_jobs,
    smoke_dataset,
    train_log,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

RULES = ("init_store", "simulate_episodes", "seal_dataset", "train_model", "evaluate_model", "plot_loss_curve")


@pytest.fixture(scope="module")
def slurm_smoke(slurm_cluster, env_with_venv, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm_smoke")
    proc = run_snakemake(workdir, env_with_venv, [SMOKE], *SLURM_ARGS)
    assert proc.returncode == 0, failure_report(proc.stdout + proc.stderr, workdir, slurm_cluster)
    return workdir


def test_outputs(slurm_smoke):
    assert (smoke_dataset(slurm_smoke) / "store.zarr").is_dir()
    assert list((slurm_smoke / "results/data/pendulum-heldout").glob("*/manifest.json"))
    (evaluation,) = (slurm_smoke / RUN_DIR / "eval").iterdir()
    for rel in (f"{RUN_DIR}/train_done.json", f"{RUN_DIR}/checkpoints/latest", f"{RUN_DIR}/loss_curve.png",
                f"{evaluation}/metrics.json", f"{evaluation}/error_vs_horizon.png", "results/mlflow.db"):
        assert (slurm_smoke / rel).exists(), rel
    record = json.loads((slurm_smoke / RUN_DIR / "train_done.json").read_text())
    assert record["final_step"] == record["target_steps"] == 40
    assert record["world_size"] == 2


def test_every_rule_ran_as_a_slurm_job(slurm_smoke):
    for rule in RULES:
        jobs = slurm_jobs(rule)
        assert jobs, f"no SLURM job for {rule}"
        assert {state for _, state in jobs} == {"COMPLETED"}, (rule, jobs)


def test_training_was_its_own_job_step(slurm_smoke):
    (job_id, _), = slurm_jobs("train_model")
    log = train_log(slurm_smoke).read_text()
    match = re.search(r"worldpipe train: job (\d+), training step on 1 node\(s\), 2 CPUs per node, "
                      r"rendezvous loopback", log)
    assert match, log[-3000:]
    assert match.group(1) == job_id


def test_digest_equals_the_workstation_run(slurm_smoke, workstation_smoke, env_with_venv):
    _, expected = workstation_smoke
    assert digest(slurm_smoke / RUN_DIR, env_with_venv) == expected

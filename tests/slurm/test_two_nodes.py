"""Two-node training through the SLURM profile: two slurmd on this host (`slurmd -N wp1`, `slurmd -N wp2`, each
on its own port), one job of two nodes, one torchrun per node (nnodes=2, nproc_per_node=1) meeting at a c10d
rendezvous on the first node's address. Same global batch and world size as the one-node, two-process smoke run,
so the same checkpoint digest."""

from __future__ import annotations

import json
import re

import pytest
from localslurm import job_field
from pipeline_runs import (
    RUN_DIR,
    SLURM_ARGS,
    SMOKE,
    TRAIN_DONE,
    digest,
    failure_report,
    overlay_config,
    run_snakemake,
    slurm_jobs,
    smoke_target,
    train_log,
)

from pipeline_project import seed_datasets

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

SLURM_NODES = ("wp1", "wp2")


@pytest.fixture(scope="module")
def two_node_run(slurm_cluster, env_with_venv, tmp_path_factory, workstation_smoke):
    assert set(slurm_cluster.node_states()) == set(SLURM_NODES)
    workdir = tmp_path_factory.mktemp("two_nodes")
    seed_datasets(workstation_smoke[0], workdir)  # training is what spans the nodes; the data rules run elsewhere
    overlay = overlay_config(workdir / "two_nodes.yaml", train={"nproc_per_node": 1, "nnodes": 2, "overrides": []})
    proc = run_snakemake(workdir, env_with_venv, [SMOKE, overlay], *SLURM_ARGS, smoke_target([SMOKE, overlay]))
    assert proc.returncode == 0, failure_report(proc.stdout + proc.stderr, workdir, slurm_cluster)
    return workdir


def test_one_job_spanning_both_nodes(two_node_run):
    (job_id, state), = slurm_jobs("train_model")
    assert state == "COMPLETED"
    assert job_field(job_id, "NumNodes") == "2"
    assert job_field(job_id, "NodeList") == "wp[1-2]"
    log = train_log(two_node_run).read_text(errors="replace")
    assert re.search(rf"worldpipe train: job {job_id}, training step on 2 node\(s\), 1 CPUs per node, "
                     r"rendezvous 127\.0\.0\.1:\d+", log), log[-3000:]


def test_two_ranks_one_per_node(two_node_run):
    record = json.loads((two_node_run / TRAIN_DONE).read_text())
    assert record["world_size"] == 2
    assert record["final_step"] == 40
    assert len(set(record["replica_digests"])) == 1  # the DDP replicas on both nodes agree


def test_digest_equals_one_node_two_processes(two_node_run, workstation_smoke, env_with_venv):
    _, expected = workstation_smoke
    assert digest(two_node_run / RUN_DIR, env_with_venv) == expected

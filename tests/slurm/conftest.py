"""Fixtures of the SLURM tests: a real cluster on localhost (tests/slurm/localslurm.py), module by module.

Each test module gets its own cluster; a module may name its nodes with `SLURM_NODES = ("wp1", "wp2")` (one
slurmd per name, all on this host). Only one cluster exists at a time: its config is /etc/slurm/slurm.conf.
A cluster left running by an interrupted run is reaped when the next one starts (localslurm.reap_leftovers);
under `--no-skips` (make test) a cluster that cannot start fails the tests instead of skipping them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from localslurm import ClusterUnavailable, LocalSlurmCluster
from pipeline_runs import (
    RUN_DIR,
    SMOKE,
    WORKSTATION_ARGS,
    digest,
    failure_report,
    run_snakemake,
    smoke_target,
)


@pytest.fixture(scope="module")
def slurm_cluster(request, tmp_path_factory) -> LocalSlurmCluster:
    """A running cluster (slurmctld + one slurmd per node name); stopped, by PID, when the module ends."""
    nodes = tuple(getattr(request.module, "SLURM_NODES", ("wp1",)))
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=nodes, kill_wait=30)
    t0 = time.monotonic()
    try:
        cluster.start()
    except ClusterUnavailable as err:
        pytest.skip(f"no local SLURM cluster: {err}")
    cluster.startup_s = time.monotonic() - t0
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def workstation_smoke(env_with_venv, tmp_path_factory) -> tuple[Path, str]:
    """The smoke config trained on this machine (local executor): (working directory, checkpoint digest)."""
    workdir = tmp_path_factory.mktemp("workstation_smoke")
    proc = run_snakemake(workdir, env_with_venv, [SMOKE], *WORKSTATION_ARGS, smoke_target([SMOKE]))
    assert proc.returncode == 0, failure_report(proc.stdout + proc.stderr, workdir)
    return workdir, digest(workdir / RUN_DIR, env_with_venv)

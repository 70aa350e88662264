"""A process that left its job (its parent exited, so proctrack/linuxproc no longer tracks it) stops with the
test cluster: a Snakemake job step that hung at exit outlived a `make test` that way."""

from __future__ import annotations

import textwrap
import time

import pytest
from localslurm import is_alive, sbatch, wait_job_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_process_that_escaped_its_job_stops_with_the_cluster(slurm_cluster, tmp_path):
    pid_file = tmp_path / "escaped.pid"
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        setsid bash -c 'echo $$ > {pid_file}; exec sleep 600' < /dev/null > /dev/null 2>&1 &
        while [ ! -s {pid_file} ]; do sleep 0.1; done
    """))
    job = sbatch("--output", str(tmp_path / "out.log"), "--ntasks=1", "--cpus-per-task=1", "--mem=100",
                 "--time=2", str(script))
    assert wait_job_end(job, timeout=60) == "COMPLETED"
    escaped = int(pid_file.read_text())
    time.sleep(1)
    assert is_alive(escaped), "the process did not outlive its job: this test no longer tests anything"
    slurm_cluster.stop()
    assert not is_alive(escaped), f"PID {escaped}, started by job {job}, outlived the test cluster"

"""The local cluster itself, and the SLURM behaviour the training launcher is built on."""

from __future__ import annotations

import textwrap

import pytest
from localslurm import job_state, run, sbatch, wait_for, wait_job_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_cluster_answers(slurm_cluster):
    assert run(["scontrol", "ping"]).returncode == 0
    assert slurm_cluster.node_states() == {"wp1": "idle"}
    config = run(["scontrol", "show", "config"]).stdout
    assert "MinJobAge               = 3600 sec" in config
    assert "accounting_storage/none" in config


def test_batch_job_and_nested_srun_without_slurm_env(slurm_cluster, tmp_path):
    """Like the executor plugin's job wrapper: SLURM_* stripped but SLURM_JOB_ID, srun still reaches the job."""
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent("""\
        #!/bin/bash
        set -eu
        echo "batch $SLURM_JOB_ID $SLURM_JOB_NUM_NODES"
        keep=$SLURM_JOB_ID
        for var in $(env | sed -n 's/^\\(SLURM_[A-Z_]*\\)=.*/\\1/p'); do unset "$var"; done
        export SLURM_JOB_ID=$keep
        srun --ntasks=1 bash -c 'echo "step $SLURM_JOB_ID.$SLURM_STEP_ID on $SLURMD_NODENAME"'
    """))
    job = sbatch("--output", str(tmp_path / "out.log"), "--ntasks=1", "--cpus-per-task=1", "--mem=100",
                 "--time=2", str(script))
    assert wait_job_end(job, timeout=60) == "COMPLETED"
    out = (tmp_path / "out.log").read_text()
    assert f"batch {job} 1" in out
    assert f"step {job}.0 on wp1" in out


def test_warning_signal_reaches_every_step_process_but_not_the_batch_shell(slurm_cluster, tmp_path):
    """`scancel --signal=USR1` (what `sbatch --signal=USR1@T` does at T) hits every process of every job step,
    children included, and never the batch step: the reason training runs as a job step of its own."""
    handler = tmp_path / "handler.py"
    handler.write_text(textwrap.dedent("""\
        import os, signal, subprocess, sys, time
        name = sys.argv[1]
        mark = lambda what: open(os.path.join(os.path.dirname(__file__), f"{name}.{what}"), "w").close()
        signal.signal(signal.SIGUSR1, lambda s, f: (mark("usr1"), sys.exit(0)))
        if len(sys.argv) > 2:
            subprocess.Popen([sys.executable, __file__, name + "-child"])
        mark("ready")
        time.sleep(120)
    """))
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        python3 {handler} batch-child &
        srun --ntasks=1 python3 {handler} step spawn
        echo "step exited $?"
        kill %1
    """))
    log = tmp_path / "out.log"
    job = sbatch("--output", str(log), "--ntasks=1", "--cpus-per-task=1", "--mem=100", "--time=3", str(script))
    wait_for(lambda: len(list(tmp_path.glob("*.ready"))) == 3, 60, "the processes to start")
    run(["scancel", "--signal=USR1", job])
    assert wait_job_end(job, timeout=60) == "COMPLETED"
    assert {p.name for p in tmp_path.glob("*.usr1")} == {"step.usr1", "step-child.usr1"}
    assert "step exited 0" in log.read_text()
    assert job_state(job) == "COMPLETED"

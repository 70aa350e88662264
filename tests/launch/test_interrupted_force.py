"""Issue 19, case 14: after an interrupted forced run, a plain `snakemake` never reports done over stale results.

Real Snakemake, torchrun and kill -9 on a copy of the project (smoke config): a finished 40-step run is forced
again with trainer.steps raised; Snakemake (only Snakemake: its training job lives on, orphaned) is killed with
SIGKILL while training holds the run. After `snakemake --unlock` a plain `snakemake` must refuse, naming the
process that holds the run - not say "Nothing to be done" while the completion record is gone and the evaluation
describes the old step 40. Once that process is gone, a plain `snakemake` resumes the run and evaluates its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline_project import Project
from processes import is_alive, pids_with_arg, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

RAISED_STEPS = 80
PAUSE_STEP = 60  # the orphan waits inside publishing this step, holding the run


def _config(repo: Path, overrides: list[str]) -> dict:
    config = yaml.safe_load((repo / "conf/pipeline/smoke.yaml").read_text())
    config["experiments"] = ["smoke"]
    config["train"]["overrides"] = overrides
    # No closed loop (its rule reruns with every evaluation; null, or the defaults' would apply): what is tested
    # here is the run lock and the completion record; tests/launch/test_run_identity.py covers
    # evaluate_control's reruns.
    config["control"] = None
    return config


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _latest_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("step-")) if latest.exists() else 0


def test_plain_run_after_killed_force_refuses_then_resumes(repo, env_with_venv, tmp_path):
    project = Project(repo, tmp_path, env_with_venv)
    project.write_config(_config(repo, []))
    first = project.snakemake()
    assert first.returncode == 0, first.stderr[-5000:]
    (run,) = project.plan()[1].values()
    run_dir = project.work / run.dir
    metrics = next((run_dir / "eval").glob("*/metrics.json"))
    assert json.loads(metrics.read_text())["checkpoint_step"] == 40

    # Forced again with more steps (a resume-safe override: the same run directory); kill -9 Snakemake alone.
    project.write_config(_config(repo, [f"trainer.steps={RAISED_STEPS}"]))
    env = dict(env_with_venv, WORLDPIPE_CKPT_FAULT=f"before_files@{PAUSE_STEP}:pause:900")
    forced = project.start("--forcerun", "train_model", env=env)
    orphans: set[int] = set()
    try:
        # Past the old end (40): the raised run is training; it then waits inside publishing step 60.
        _wait_for(lambda: _latest_step(run_dir) >= PAUSE_STEP - 10, 900, "the forced training to pass step 40")
        # While Snakemake runs it (its console goes to a log file), the training's progress is on show.
        status = subprocess.run(["worldpipe", "runs", "status", "--runs-dir", str(project.work / "results/runs")],
                                env=env_with_venv, capture_output=True, text=True, timeout=120)
        (row,) = [line for line in status.stdout.splitlines() if run_dir.name in line]
        step, target = (int(n) for n in row.split()[1].split("/"))
        assert target == RAISED_STEPS and step >= PAUSE_STEP - 10 and "running" in row, status.stdout
        assert row.split()[4] != "-", row  # an ETA
        os.kill(forced.pid, signal.SIGKILL)
        forced.wait(timeout=60)
        orphans = pids_with_arg(run_dir.name, cwd=project.work)
        holder = json.loads((run_dir / ".run.lock").read_text())["pid"]
        assert holder in orphans and is_alive(holder), "the training must outlive the killed Snakemake"

        assert project.snakemake("--unlock").returncode == 0
        plain = project.snakemake()
        output = plain.stdout + plain.stderr
        assert "Nothing to be done" not in output, output[-3000:]
        assert plain.returncode != 0, output[-3000:]
        assert f"pid {holder}" in output and "in use" in output, output[-3000:]
        assert not (run_dir / "train_done.json").exists()
        assert not list((run_dir / "eval").glob("*/metrics.json")), "stale evaluation of step 40 still present"
    finally:
        for pid in orphans | pids_with_arg(run_dir.name, cwd=project.work):  # the test stops what it started, by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not wait_gone(orphans | pids_with_arg(run_dir.name, cwd=project.work), timeout=60)

    # The holder is gone: a plain run resumes the run and evaluates where it ends.
    resumed = project.snakemake()
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-5000:]
    done = json.loads((run_dir / "train_done.json").read_text())
    assert done["final_step"] == RAISED_STEPS
    metrics = next((run_dir / "eval").glob("*/metrics.json"))
    assert json.loads(metrics.read_text())["checkpoint_step"] == RAISED_STEPS
    attempts = json.loads((run_dir / "run.json").read_text())["attempts"]
    assert attempts[-1]["exit_code"] == 0 and len(attempts) == 3  # first run, the killed force, the resume

"""Issue 19, items 6-12 at the user's end: `worldpipe train` and `snakemake -n` refuse bad input with one line
before any process starts (or any job is planned); a rank whose stderr fails still has its error shown."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline_project import dry_run
from processes import pids_with_arg, wait_gone

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]


def train(run_dir: Path, dataset, env, *extra: str, experiment: str = "smoke") -> subprocess.CompletedProcess:
    store, manifest = dataset
    cmd = ["worldpipe", "train", f"experiment={experiment}", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", "tracking.enabled=false", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(("extra", "needles"), [
    (["data.window=100000"], ["config key 'data.window'", "100000", "at most 64 steps"]),
    (["model.stoch=-1"], ["config key 'model.stoch'", "positive integer"]),
    (["tracking.enabled=true", "tracking.uri=htp://localhost:5000"], ["config key 'tracking.uri'", "htp"]),
])
def test_train_refuses_before_any_process_starts(extra, needles, tmp_path, smoke_dataset, env_with_venv):
    line = one_line(train(tmp_path / "run", smoke_dataset, env_with_venv, *extra))
    assert all(needle in line for needle in needles), line
    assert not (tmp_path / "run").exists()  # no run directory, no lock file, no rank


# ---- the pipeline: refused while the Snakefile is parsed, no job planned ----

def sweep_case(repo: Path, **sweep) -> dict:
    config = yaml.safe_load((repo / "conf/pipeline/sweep_smoke.yaml").read_text())
    config["sweep"].update(sweep)
    return config


def smoke_case(repo: Path, overrides: list[str], **changes) -> dict:
    config = yaml.safe_load((repo / "conf/pipeline/smoke.yaml").read_text())
    config["train"]["overrides"] = overrides
    return config | changes


CASES = {
    "sweep_unknown_key": (lambda r: sweep_case(r, grid={"trainer.lrr": [0.1, 0.2]}), "'sweep.grid.trainer.lrr'"),
    "sweep_negative_lr": (lambda r: sweep_case(r, grid={"trainer.lr": [-1, 0.1]}), "config key 'trainer.lr'"),
    "sweep_name_dotdot": (lambda r: sweep_case(r, name=".."), "'sweep.name': '..' is not a safe directory name"),
    "sweep_name_escape": (lambda r: sweep_case(r, name="../../etc"), "'sweep.name': '../../etc' is not a safe"),
    "sweep_unknown_experiment": (lambda r: sweep_case(r, experiment="nosuch"), "'sweep.experiment'"),
    "tracking_uri_shell_text": (lambda r: smoke_case(r, [], tracking_uri="http://x; rm -rf ~"), "tracking_uri: "),
    "window_too_long": (lambda r: smoke_case(r, ["data.window=100000"]), "config key 'data.window'"),
    "layout_rank_count": (lambda r: smoke_case(r, ["parallel=dp_tp"], experiments=["smoke_transformer"]),
                          "train.nproc_per_node"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_snakemake_refuses_at_parse_time_planning_no_jobs(case, repo, tmp_path, env_with_venv):
    make, needle = CASES[case]
    proc = dry_run(repo, tmp_path / "wd", env_with_venv, make(repo))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    line = next((line for line in output.splitlines() if needle in line), None)
    assert line is not None, output[-3000:]
    if case.startswith("sweep_"):  # the sweep's checks name the file they read
        assert str(tmp_path / "wd" / "pipeline.yaml") in line, line
    assert "Job stats" not in output and "train_sweep_point" not in output and "train_model" not in output
    assert not (tmp_path / "wd" / "results").exists()


# ---- item 12: a rank whose stderr fails (EIO on every write) still has its cause shown ----

def _rank0_worker(run_dir: Path, ctl: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        for pid in pids_with_arg(str(run_dir)):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"worldpipe.launch.worker" in argv and b"RANK=0" in environ and Path(f"{ctl}-{pid}.in").exists():
                return pid
        time.sleep(0.1)
    raise AssertionError("rank 0 never started")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("fiu-run") is None, reason="libfiu's fiu-run/fiu-ctrl are not installed")
def test_write_errors_on_rank_0_show_the_primary_cause_in_one_line(tmp_path, smoke_dataset, env_with_venv):
    store, manifest = smoke_dataset
    run_dir, ctl = tmp_path / "run", tmp_path / "fiu-ctl"
    cmd = ["fiu-run", "-x", "-f", str(ctl), "worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}",
           f"data.store={store}", f"data.manifest={manifest}", "tracking.enabled=false", "trainer.steps=2000",
           "checkpoint.every=10", "trainer.progress_bar=false"]
    launcher = subprocess.Popen(cmd, env=env_with_venv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rank0 = _rank0_worker(run_dir, ctl, time.monotonic() + 180)
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "step-000010").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        # From now on every write() of rank 0 fails with EIO: its next checkpoint file, and its own stderr.
        subprocess.run(["fiu-ctrl", "-f", str(ctl), "-c", "enable name=posix/io/rw/write,failinfo=5", str(rank0)],
                       check=True, timeout=30)
        _, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert launcher.returncode != 0 and len(lines) == 1, stderr
    assert lines[0].startswith("error: saving checkpoint step ") and "[Errno 5]" in lines[0], lines[0]
    assert "Connection closed" not in lines[0]
    assert not wait_gone(pids_with_arg(str(run_dir)))


def test_data_info_on_a_missing_path_is_one_line_naming_it(tmp_path, env_with_venv):
    missing = tmp_path / "results" / "data" / "nope"
    proc = subprocess.run(["worldpipe", "data", "info", str(missing)], env=env_with_venv, capture_output=True,
                          text=True, timeout=120)
    line = one_line(proc)
    assert str(missing) in line and "no trajectory store" in line and "unexpected" not in line


@pytest.mark.parametrize("flags", [[], ["--cfg", "job"]])
def test_an_unknown_experiment_is_one_short_line_also_under_hydra_flags(flags, tmp_path, env_with_venv, repo):
    proc = subprocess.run(["worldpipe", "train", "experiment=nope", *flags], env=env_with_venv, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    line = one_line(proc)
    experiments = sorted(p.stem for p in (repo / "conf/experiment").glob("*.yaml"))
    assert line == f"error: config group 'experiment': no option 'nope'; available: {', '.join(experiments)}"

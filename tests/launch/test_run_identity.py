"""Config-addressed runs through real Snakemake, torchrun and MLflow, on a throwaway copy of the project.

Two smoke experiments that differ in that `smoke_wd` spells `trainer.weight_decay` out in its overlay (an edit of
that key in conf/trainer/default.yaml changes the resolved config of `smoke` alone) and trains on a dataset of its
own (`pendulum_wd`: the smoke dataset's settings with another seed).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline_project import Project, files_of, kill_tree, planned_jobs
from worldpipe.tracking.spool import Spool

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

RUN_RULES = {"train_model", "evaluate_model", "evaluate_control", "plot_loss_curve"}


def smoke_config(repo: Path, overrides: list[str] | None = None) -> dict:
    """The module's pipeline config: the smoke pipeline training `smoke` and `smoke_wd`, the latter on its own
    dataset."""
    config = yaml.safe_load((repo / "conf/pipeline/smoke.yaml").read_text())
    config["experiments"] = ["smoke", "smoke_wd"]
    config["datasets"]["pendulum_wd"] = dict(config["datasets"]["pendulum"], seed=1)
    config["train"]["overrides"] = overrides or []
    # The closed loop is planned and rerun as a run's rule, in its shortest form (no `worldpipe serve`: the
    # smoke pipeline's tests cover that path).
    config["control"] |= {"episodes": 1, "http_episodes": 0}
    return config


def add_overlay(project: Project, name: str, *edits: tuple[str, str]) -> None:
    """conf/experiment/<name>.yaml: the smoke overlay under another name, with each (old, new) edit made."""
    text = (project.src / "conf/experiment/smoke.yaml").read_text()
    for old, new in (("experiment_name: smoke", f"experiment_name: {name}"), *edits):
        assert old in text, old
        text = text.replace(old, new, 1)
    (project.src / f"conf/experiment/{name}.yaml").write_text(text)


def mlflow_run(project: Project, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project.work / 'results/mlflow.db'}")
    run = client.get_run(run_id)
    return run.info.status, run.info.end_time, run.data.params, len(client.get_metric_history(run_id, "loss/total"))


def done_record(project: Project, run) -> dict:
    return json.loads((project.work / run.dir / "train_done.json").read_text())


@pytest.fixture(scope="module")
def project(repo, env_with_venv, tmp_path_factory) -> Project:
    project = Project(repo, tmp_path_factory.mktemp("identity"), env_with_venv)
    add_overlay(project, "smoke_wd", ("trainer:\n", "trainer:\n  weight_decay: 0.0\n"),
                ("data:\n", "data:\n  name: pendulum_wd\n"))
    project.write_config(smoke_config(repo))
    proc = project.snakemake()
    assert proc.returncode == 0, proc.stderr[-5000:]
    return project


def test_each_experiment_trains_on_its_own_dataset(project):
    datasets, runs = project.plan()
    seen = {}
    for name, run in runs.items():
        record = done_record(project, run)
        step_dir = project.work / run.dir / "checkpoints" / f"step-{record['final_step']:06d}"
        identity = json.loads((step_dir / "identity.json").read_text())
        manifest = json.loads((project.work / run.dataset.dir / "manifest.json").read_text())
        assert identity["dataset_hash"] == manifest["dataset_hash"]
        assert identity["config"]["data"]["name"] == run.dataset.name
        seen[name] = (run.dataset.name, identity["dataset_hash"])
    assert seen["smoke"][0] == "pendulum" and seen["smoke_wd"][0] == "pendulum_wd"
    assert seen["smoke"][1] != seen["smoke_wd"][1]
    assert datasets["pendulum"].dir != datasets["pendulum_wd"].dir


def test_trainer_edit_trains_exactly_the_affected_experiment_into_a_new_run(project):
    _, before = project.plan()
    old_dir = project.work / before["smoke"].dir
    old_files = files_of(old_dir)
    old_id = done_record(project, before["smoke"])["mlflow_run_id"]
    old_mlflow = mlflow_run(project, old_id)

    project.edit("conf/trainer/default.yaml", "weight_decay: 0.0", "weight_decay: 1.0e-4")
    _, after = project.plan()
    assert after["smoke"].run_hash != before["smoke"].run_hash
    assert after["smoke_wd"].run_hash == before["smoke_wd"].run_hash
    dry = project.snakemake("--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = planned_jobs(dry.stdout + dry.stderr)
    # Jobs of one run (aggregates over every experiment, such as `all`, name no experiment).
    assert {job for job in jobs if job[1]} == {(rule, "smoke") for rule in RUN_RULES}

    proc = project.snakemake()
    assert proc.returncode == 0, proc.stderr[-5000:]
    record = done_record(project, after["smoke"])
    identity = json.loads((project.work / after["smoke"].dir / "checkpoints" / f"step-{record['final_step']:06d}"
                           / "identity.json").read_text())
    assert identity["config"]["trainer"]["weight_decay"] == 1.0e-4
    assert identity["config_hash"] == after["smoke"].config_hash
    assert (project.work / "results/runs/smoke/latest").resolve() == (project.work / after["smoke"].dir).resolve()
    # The earlier run: every file as it was, its MLflow run as it was, beside the new one.
    assert files_of(old_dir) == old_files
    assert mlflow_run(project, old_id) == old_mlflow
    assert record["mlflow_run_id"] != old_id

    project.edit("conf/trainer/default.yaml", "weight_decay: 1.0e-4", "weight_decay: 0.0")
    dry = project.snakemake("--dry-run")
    # Every product, the summary over all runs included (named by the set of runs), is the one already there.
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]


def test_safe_key_changes_neither_hash_nor_dag(project, repo):
    _, before = project.plan()
    project.write_config(smoke_config(repo, ["trainer.log_every=7"]))
    try:
        _, after = project.plan()
        assert {name: run.run_hash for name, run in after.items()} == \
            {name: run.run_hash for name, run in before.items()}
        dry = project.snakemake("--dry-run")
        assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    finally:
        project.write_config(smoke_config(repo))


def test_override_change_trains_new_runs_and_a_killed_one_resumes_in_its_directory(project, repo):
    _, before = project.plan()
    old = {name: files_of(project.work / run.dir) for name, run in before.items()}
    project.write_config(smoke_config(repo, ["trainer.lr=0.002"]))
    _, after = project.plan()
    dry = project.snakemake("--dry-run")
    jobs = {job for job in planned_jobs(dry.stdout + dry.stderr) if job[1]}
    assert jobs == {(rule, name) for rule in RUN_RULES for name in ("smoke", "smoke_wd")}

    # Training pauses before publishing step 20, so the newest checkpoint at the kill is step 10.
    env = dict(project.env, WORLDPIPE_CKPT_FAULT="before_files@20:pause:600")
    proc = project.start(env=env)
    pointers = [project.work / run.dir / "checkpoints/latest" for run in after.values()]
    deadline = time.monotonic() + 600
    while not any(p.exists() for p in pointers) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    killed = next((name for name, p in zip(after, pointers, strict=True) if p.exists()), None)
    if killed is not None:
        # Training is held before step 20's files; the run start (which no save waits for) may still be in
        # flight: the kill waits for it, so that the run to be continued is known.
        while not Spool(project.work / after[killed].dir).state()["run_id"] and time.monotonic() < deadline:
            time.sleep(0.2)
    kill_tree(proc)
    assert killed is not None, "no checkpoint appeared before the pipeline ended"
    killed_dir = project.work / after[killed].dir
    assert (killed_dir / "checkpoints/latest").read_text().strip() == "step-000010"
    listing = subprocess.run(["worldpipe", "runs", "list", "--runs-dir", str(project.work / "results/runs"), killed],
                             env=project.env, capture_output=True, text=True, timeout=120)
    assert "interrupted at step 10" in listing.stdout, listing.stdout + listing.stderr
    spooled_id = Spool(killed_dir).state()["run_id"]  # the run the resume reopens
    assert spooled_id, "the run start was not acknowledged while training was held"
    experiment_dir = project.work / "results/runs" / killed
    dirs_at_kill = sorted(p.name for p in experiment_dir.iterdir())

    assert project.snakemake("--unlock").returncode == 0
    rerun = project.snakemake("--rerun-incomplete")
    assert rerun.returncode == 0, rerun.stderr[-5000:]
    assert "Error in rule" not in rerun.stdout + rerun.stderr
    record = json.loads((killed_dir / "train_done.json").read_text())
    assert record["final_step"] == 40 and record["mlflow_run_id"] == spooled_id
    attempts = json.loads((killed_dir / "run.json").read_text())["attempts"]
    assert [a["exit_code"] for a in attempts] == [None, 0]
    assert sorted(p.name for p in experiment_dir.iterdir()) == dirs_at_kill  # resumed, no new directory
    for name, run in before.items():
        assert files_of(project.work / run.dir) == old[name]

"""`worldpipe train` is the Hydra app: Hydra's flags work on it, and its help lists training config only."""

from __future__ import annotations

import subprocess

import pytest
import yaml

pytestmark = pytest.mark.integration


def train(*args: str, env: dict, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["worldpipe", "train", *args], env={**env, **(extra_env or {})}, capture_output=True,
                          text=True, timeout=300)


def test_help_lists_the_training_groups_only(env_with_venv):
    proc = train("--help", env=env_with_venv)
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "experiment: cartpole_rssm" in groups and "model: augmented_rssm" in groups
    assert "pipeline" not in groups and "schema" not in groups  # Snakemake's configs, structured schemas


def test_cfg_job_prints_the_composed_config_and_trains_nothing(env_with_venv, tmp_path):
    proc = train("--cfg", "job", "experiment=smoke", "trainer.lr=3e-4", f"run_dir={tmp_path / 'run'}",
                 env=env_with_venv)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["trainer"]["lr"] == 3e-4 and cfg["experiment_name"] == "smoke"
    assert not (tmp_path / "run").exists()


def test_shell_completion_completes_groups_through_the_worldpipe_executable(env_with_venv):
    install = train("-sc", "install=bash", env=env_with_venv)
    assert install.returncode == 0 and install.stdout.rstrip().endswith("hydra_bash_completion worldpipe")
    query = subprocess.run(["worldpipe", "-sc", "query=bash"], capture_output=True, text=True, timeout=300,
                           env={**env_with_venv, "COMP_LINE": "worldpipe train experiment=smoke_g"})
    assert query.returncode == 0, query.stderr
    assert query.stdout.split() == ["experiment=smoke_gru"]


def _data(smoke_dataset) -> list[str]:
    store, manifest = smoke_dataset
    return [f"data.store={store}", f"data.manifest={manifest}", "trainer.progress_bar=false", "parallel=single"]


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_train_ends_naming_its_run_dir_and_the_mlflow_run_in_the_model_training_view(env_with_venv, tmp_path,
                                                                                   smoke_dataset):
    run_dir = tmp_path / "run"
    proc = train("experiment=smoke", f"run_dir={run_dir}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                 "trainer.steps=10", *_data(smoke_dataset), env=env_with_venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    done = __import__("json").loads((run_dir / "train_done.json").read_text())
    run_id = done["mlflow_run_id"]
    assert done["mlflow_experiment_id"] == "1"  # the link needs no MLflow lookup at the end of the run
    assert last == (f"run directory: {run_dir}; MLflow run: http://127.0.0.1:5000/#/experiments/1/runs/{run_id}"
                    "?workflowType=machine_learning")


@pytest.mark.slow
def test_multirun_trains_each_job_into_its_own_run_dir(env_with_venv, tmp_path, smoke_dataset):
    sweep = tmp_path / "multirun"
    proc = train("-m", "experiment=smoke", "trainer.lr=1e-3,3e-3", "trainer.steps=10", "tracking.enabled=false",
                 f"hydra.sweep.dir={sweep}", *_data(smoke_dataset), env=env_with_venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = sorted(yaml.safe_load((sweep / str(job) / "hydra" / "config.yaml").read_text())["trainer"]["lr"]
                 for job in (0, 1))
    assert lrs == [1e-3, 3e-3]
    for job in (0, 1):
        assert (sweep / str(job) / "train_done.json").is_file()


def test_closing_line_says_when_the_completion_record_cannot_be_read(tmp_path):
    from omegaconf import OmegaConf

    from worldpipe.commands.train import closing_line

    cfg = OmegaConf.create({"run_dir": str(tmp_path), "tracking": {"uri": f"sqlite:///{tmp_path / 'm.db'}"}})
    assert closing_line(cfg) == f"run directory: {tmp_path}; MLflow run: none (tracking off)"
    (tmp_path / "train_done.json").mkdir()  # unreadable, as a disk that lost power answers EIO
    line = closing_line(cfg)
    assert line.startswith(f"run directory: {tmp_path}; MLflow run: unknown (train_done.json unreadable: ")

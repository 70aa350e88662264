"""`worldpipe train` is the Hydra app: Hydra's flags work on it, and its help lists training config only."""

from __future__ import annotations

import subprocess

import yaml


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

"""Case 5 of issue 9 under Snakemake: a training failure (a failing disk during a checkpoint save, injected
as EIO) makes the rule fail with exactly one error line in its log, naming the step, and no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.adversarial, pytest.mark.integration, pytest.mark.slow]


def test_failed_training_rule_logs_one_line(repo: Path, tmp_path, env_with_venv):
    config = yaml.safe_load((repo / "conf" / "pipeline" / "smoke.yaml").read_text())
    dataset = next(iter(config["datasets"].values()))
    dataset.update(episodes=8, episodes_per_shard=4)
    dataset["heldout"]["episodes"] = 2
    config["simulate_jobs"] = 1
    config["train"]["overrides"] = ["tracking.enabled=false", "trainer.steps=20", "checkpoint.every=10"]
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "pipeline.yaml").write_text(yaml.safe_dump(config))
    env = {**env_with_venv, "WORLDPIPE_CKPT_FAULT": "mid_files@10:raise"}
    proc = subprocess.run(["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
                           "--until", "train_model", "--configfile", str(workdir / "pipeline.yaml")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    logs = sorted(workdir.rglob("train_model/smoke*.log"))
    assert len(logs) == 1, (logs, proc.stderr[-3000:])
    log = logs[0].read_text()
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert len(errors) == 1, log[-4000:]
    assert "step 10" in errors[0] and "injected fault" in errors[0], errors
    for noise in ("Traceback", "ChildFailedError", "Connection closed by peer"):
        assert noise not in log, log[-4000:]
    error_logs = list(workdir.rglob("errors.log"))
    assert len(error_logs) == 1 and "Traceback (most recent call last)" in error_logs[0].read_text()
    assert not list(workdir.rglob("train_done.json"))

"""The README's main command in miniature: the default pipeline config, end to end, beats the baseline.

Only the RSSM experiment of the defaults runs here (the one this test asserts on): the default GRU experiment
would double the time and is trained through the pipeline by `make pipeline` and by its own tests."""

import json
import subprocess

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_default_pipeline_beats_repeat_last_observation(repo, env_with_venv, tmp_path):
    # the closed loop of the defaults, shortened (its full length is measured by `make pipeline`); a config file,
    # because `--config key={...}` hands nested values to the schema as strings
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"experiments": ["pendulum_rssm"], "control": {
        "episodes": 2, "seed": 5000, "context": 8, "planner": "mppi", "max_steps": 40, "http_episodes": 1}}))
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(tmp_path), "--profile",
           str(repo / "workflow/profiles/workstation"), "--configfile", str(repo / "conf/pipeline/default.yaml"),
           str(overlay)]
    proc = subprocess.run(cmd, env=env_with_venv, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (evaluation,) = (tmp_path / "results/runs/pendulum_rssm/latest/eval").iterdir()
    metrics = json.loads((evaluation / "metrics.json").read_text())
    assert metrics["segments"] >= 100
    assert metrics["one_step_ratio"] < 1.0, metrics["one_step_ratio"]
    assert all(ratio < 1.0 for ratio in metrics["ratio"]), metrics["ratio"]
    (control,) = (tmp_path / "results/runs/pendulum_rssm/latest/control").iterdir()
    record = json.loads((control / "control.json").read_text())
    assert record["settings"]["episodes"] == 2 and record["settings"]["max_steps"] == 40
    assert record["http_takes_the_in_process_actions"] is True
    assert (control / "returns.png").stat().st_size > 0 and (control / "control_loop.png").stat().st_size > 0

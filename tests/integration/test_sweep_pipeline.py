"""The 2x2 smoke sweep end to end: four trained + evaluated runs nested under one parent run, compared by
`worldpipe compare` (table and plot) and in the MLflow UI (headless Chromium screenshots of the compare view and
of the experiment in the model-training view).

Set WORLDPIPE_SCREENSHOT_DIR to keep the screenshots.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_support import run_group

from worldpipe.tracking.evaluation import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
from worldpipe.tracking.sweep_runs import point_runs

# Whole pipelines in the module fixture: well past the default per-test timeout on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

SWEEP = "smoke_sweep"
PNG = b"\x89PNG\r\n\x1a\n"


def snakemake(repo: Path, workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(repo / "conf/pipeline/sweep_smoke.yaml"), *args]
    return run_group(cmd, env, timeout=1500)


@pytest.fixture(scope="module")
def swept(repo, env_with_venv, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sweep")
    proc = snakemake(repo, workdir, env_with_venv)
    assert proc.returncode == 0, proc.stderr[-5000:]
    uri = f"sqlite:///{workdir / 'results/mlflow.db'}"
    parent = json.loads((workdir / f"results/sweeps/{SWEEP}/parent.json").read_text())
    return {"dir": workdir, "uri": uri, "client": MlflowClient(uri), "parent": parent["run_id"],
            "sweep_dir": workdir / f"results/sweeps/{SWEEP}"}


def test_every_point_is_a_run_nested_under_the_sweep_parent(swept):
    client = swept["client"]
    runs = point_runs(client, swept["parent"])
    assert len(runs) == 4
    assert {(r.data.params["trainer.lr"], r.data.params["model.stoch"]) for r in runs} == {
        ("0.001", "4"), ("0.001", "8"), ("0.003", "4"), ("0.003", "8")}
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == swept["parent"]
        assert "eval/one_step_ratio" in run.data.metrics and "eval/final_ratio" in run.data.metrics
        done = json.loads((swept["sweep_dir"] / run.data.tags["worldpipe.sweep.point"] / "train_done.json").read_text())
        assert done["mlflow_run_id"] == run.info.run_id
        assert run.data.tags["worldpipe.eval.checkpoint_digest"] == done["digest"]
    experiment = client.get_experiment(runs[0].info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND


def test_the_sweep_comparison_shows_swept_params_and_evaluation(swept):
    table = (swept["sweep_dir"] / "compare.txt").read_text()
    lines = table.splitlines()
    for key in ("trainer.lr", "model.stoch", "eval/one_step_ratio", "eval/final_ratio", "loss/total"):
        row = next(line for line in lines if line.startswith(key))
        assert len(row.split()) == 1 + 4, row  # the key and one cell per point
    assert (swept["sweep_dir"] / "compare.png").read_bytes()[:8] == PNG


def test_compare_cli_on_run_ids_and_bad_references(swept, env_with_venv, tmp_path):
    runs = point_runs(swept["client"], swept["parent"])
    plot = tmp_path / "two.png"
    proc = subprocess.run(["worldpipe", "compare", runs[0].info.run_id, runs[1].info.run_id, "--tracking-uri",
                           swept["uri"], "--plot", str(plot), "--metric", "eval/final_ratio"],
                          env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model.stoch" in proc.stdout and "trainer.lr" not in proc.stdout  # only what differs
    assert plot.read_bytes()[:8] == PNG
    bad = subprocess.run(["worldpipe", "compare", "no-such-run", "--tracking-uri", swept["uri"]],
                         env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no-such-run" in bad.stderr


def test_a_second_invocation_has_nothing_to_do(repo, swept, env_with_venv):
    proc = snakemake(repo, swept["dir"], env_with_venv, "--dry-run")
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr


def _screenshot(repo: Path, env: dict, uri: str, out: Path, *args: str) -> dict:
    script = repo / "workflow" / "scripts" / "screenshot_mlflow_ui.py"
    proc = subprocess.run([sys.executable, str(script), "--tracking-uri", uri, "--out", str(out), "--install", *args],
                          env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode == 3:
        pytest.skip("Debian's chromium is not installed and cannot be installed here")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.read_bytes()[:8] == PNG and summary["bytes"] > 10_000
    keep = os.environ.get("WORLDPIPE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / out.name)
    return summary


def test_ui_compare_view_shows_two_sweep_runs_with_their_evaluation_metrics(repo, swept, env_with_venv, tmp_path):
    runs = point_runs(swept["client"], swept["parent"])[:2]
    summary = _screenshot(repo, env_with_venv, swept["uri"], tmp_path / "mlflow_compare.png",
                          "--compare", *(r.info.run_id for r in runs), "--expect", "eval/one_step_ratio",
                          "--expect", "eval/final_ratio")
    assert set(summary["shown"]) >= {r.info.run_name for r in runs}


def test_ui_opens_the_experiment_in_the_model_training_view(repo, swept, env_with_venv, tmp_path):
    # ">Training runs<" (the sidebar entry and the title of the run list) is only there for an experiment of
    # the model-training kind; an untagged experiment lists its runs as GenAI "Evaluation runs".
    summary = _screenshot(repo, env_with_venv, swept["uri"], tmp_path / "mlflow_training_view.png",
                          "--expect", ">Training runs<")
    assert summary["shown"] == [SWEEP]  # the point runs are nested (collapsed) under the sweep's parent run

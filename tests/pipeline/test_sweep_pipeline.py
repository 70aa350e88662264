"""The 2x2 smoke sweep end to end: four trained + evaluated runs nested under one parent run, compared by
`worldpipe compare` (table and plot) and in the MLflow UI (headless Chromium, a real `mlflow server` on
127.0.0.1): the compare view, the experiment, the parent run, the best point's run, its evaluation-by-horizon
artifact and its logged model, every page in the Model training view.

Set WORLDPIPE_SCREENSHOT_DIR to keep the compare/experiment screenshots; the page screenshots are kept under
results/ui/ (their paths are printed).
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
from pipeline_project import report_clicks
from worldpipe.tracking.evaluation import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
from worldpipe.tracking.groups import point_runs

# Whole pipelines in the module fixture: well past the default per-test timeout on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

SWEEP = "smoke_sweep"
PNG = b"\x89PNG\r\n\x1a\n"
# The sidebar tells the UI's two layouts apart: "Model registry" is only in Model training, "Judges" only in GenAI.
MODEL_TRAINING, GENAI = ">Model registry<", ">Judges<"


def snakemake(repo: Path, workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(repo / "conf/pipeline/sweep_smoke.yaml"), *args]
    return run_group(cmd, env, timeout=1500)


@pytest.fixture(scope="module")
def swept(readme_pipelines):
    """The docs' sweep (`snakemake --cores 2 --configfile conf/pipeline/sweep_smoke.yaml`), as it ran."""
    workdir, _ = readme_pipelines
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


def test_the_sweep_report_shows_the_comparison_and_every_point_two_clicks_deep(repo, swept, env_with_venv):
    # The docs' smoke pipeline ran after the sweep here, so a bare report renders the smoke run (that is
    # test_pipeline_smoke's no-flag report test): name the sweep's config, and write a report of its own.
    proc = snakemake(repo, swept["dir"], env_with_venv, "--report", "results/report-sweep.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    clicks = report_clicks((swept["dir"] / "results/report-sweep.html").read_text())
    points = sorted(p.name for p in swept["sweep_dir"].iterdir() if (p / "eval/error_vs_horizon.png").is_file())
    assert len(points) == 4, points
    shown = {labels.get("point"): (depth, category) for depth, category, labels in clicks.values()}
    assert set(points) < set(shown), (points, sorted(clicks))
    assert all(category == f"Sweep {SWEEP}" for _, category in shown.values()), shown
    assert any(path.endswith("compare.png") for path in clicks), sorted(clicks)
    assert max(depth for depth, _, _ in clicks.values()) <= 2, clicks


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
    summary = _screenshot(repo, env_with_venv, swept["uri"], tmp_path / "mlflow_training_view.png",
                          "--expect", MODEL_TRAINING, "--refuse", GENAI)
    # The point runs are nested (collapsed) under the sweep's parent run; the docs' smoke run shares the store.
    points = {run.info.run_name for run in point_runs(swept["client"], swept["parent"])}
    assert SWEEP in summary["shown"] and not points & set(summary["shown"]), summary["shown"]


def test_the_parent_names_the_best_point_and_points_are_named_by_their_values(swept):
    client = swept["client"]
    parent = client.get_run(swept["parent"])
    runs = point_runs(client, swept["parent"])
    assert sorted(r.info.run_name for r in runs) == [
        "lr=1e-3,stoch=4", "lr=1e-3,stoch=8", "lr=3e-3,stoch=4", "lr=3e-3,stoch=8"]
    assert parent.data.params == {"sweep.points": "4", "trainer.lr": "[0.001, 0.003]", "model.stoch": "[4, 8]"}
    best = min(runs, key=lambda r: r.data.metrics["eval/one_step_ratio"])
    assert parent.data.tags["worldpipe.sweep.best_run"] == best.info.run_name
    assert parent.data.metrics["eval/one_step_ratio"] == best.data.metrics["eval/one_step_ratio"]
    assert parent.data.metrics["eval/final_ratio"] == best.data.metrics["eval/final_ratio"]
    assert parent.info.end_time >= max(r.info.end_time for r in runs)  # spans its points


def test_ui_shows_the_parent_a_point_its_horizon_table_and_its_model_in_the_model_training_view(
        repo, swept, env_with_venv):
    client = swept["client"]
    best_id = client.get_run(swept["parent"]).data.tags["worldpipe.sweep.best_run_id"]
    best = client.get_run(best_id)
    (model,) = client.search_logged_models([best.info.experiment_id], filter_string=f"source_run_id = '{best_id}'")
    datasets = {d.dataset.name for d in best.inputs.dataset_inputs}
    out = repo / "results" / "ui"
    pages = [f"run:{swept['parent']}", f"run:{best_id}", f"artifacts:{best_id}/evaluation/by_horizon.json",
             f"model:{model.model_id}"]
    script = repo / "workflow" / "scripts" / "screenshot_mlflow_ui.py"
    proc = subprocess.run([sys.executable, str(script), "--tracking-uri", swept["uri"], "--out", str(out),
                           "--install", *(arg for page in pages for arg in ("--page", page)),
                           "--expect", MODEL_TRAINING, "--refuse", GENAI, "--expect", best.info.run_name],
                          env=env_with_venv, capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip("Debian's chromium is not installed and cannot be installed here")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    shots = json.loads(proc.stdout.strip().splitlines()[-1])["pages"]
    print("MLflow UI screenshots:", *(shot["screenshot"] for shot in shots), sep="\n  ")
    parent, run, table, logged = (Path(shot["screenshot"]).with_suffix(".html").read_text() for shot in shots)
    assert all(Path(shot["screenshot"]).read_bytes()[:8] == PNG for shot in shots)
    assert ">sweep.points<" in parent and ">trainer.lr<" in parent and ">eval/one_step_ratio<" in parent
    assert ">world_model<" in run and all(name in run for name in datasets)  # its logged model, its inputs
    assert ">by_horizon.json<" in table and ">error_vs_horizon.png<" in table and '"mse_ratio"' in table
    assert ">Datasets used<" in logged and ">eval/one_step_ratio<" in logged and ">system/" not in logged
    assert all(name in logged for name in datasets), datasets

"""The whole Snakemake DAG on the tiny config, in a fresh directory, with every real component."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from pipeline_project import plan_of
from worldpipe import paths

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def snakemake(repo: Path, workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(repo / "conf/pipeline/smoke.yaml"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def pipeline_dir(repo, env_with_venv, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("pipeline")
    proc = snakemake(repo, workdir, env_with_venv)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return workdir


RUN = "results/runs/smoke/latest"  # the run the pipeline started last: here, the current config's


def test_outputs_exist(pipeline_dir, repo):
    datasets, runs = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    assert (pipeline_dir / RUN).resolve() == (pipeline_dir / runs["smoke"].dir).resolve()
    for rel in (
        f"{datasets['pendulum'].dir}/store.zarr/zarr.json",
        f"{datasets['pendulum'].dir}/manifest.json",
        f"{datasets['pendulum-heldout'].dir}/manifest.json",
        "results/runs/smoke/latest/train_done.json",
        "results/runs/smoke/latest/checkpoints/latest",
        f"{RUN}/eval/{paths.short(runs['smoke'].eval_hash)}/metrics.json",
        f"{RUN}/eval/{paths.short(runs['smoke'].eval_hash)}/error_vs_horizon.png",
        f"{RUN}/loss_curve.png",
        "results/mlflow.db",
    ):
        assert (pipeline_dir / rel).exists(), rel
    metrics = json.loads(next((pipeline_dir / RUN / "eval").glob("*/metrics.json")).read_text())
    assert len(metrics["model_mse"]) == metrics["horizon"] == 8
    assert metrics["one_step_ratio"] > 0


def test_checkpoint_manifest_lists_every_file_with_sha256(pipeline_dir):
    ckpt_root = pipeline_dir / "results/runs/smoke/latest/checkpoints"
    step_dir = ckpt_root / (ckpt_root / "latest").read_text().strip()
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    listed = {entry["path"]: entry for entry in manifest["files"]}
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert set(listed) == on_disk
    for rel, entry in listed.items():
        data = (step_dir / rel).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_mlflow_run_has_every_config_key(pipeline_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from worldpipe.config import flatten

    record = json.loads((pipeline_dir / "results/runs/smoke/latest/train_done.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{pipeline_dir / 'results/mlflow.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    identity_file = client.download_artifacts(run.info.run_id, "identity.json", str(tmp_path))
    config = json.loads(Path(identity_file).read_text())["config"]
    flat = flatten(config)
    assert set(flat) <= set(run.data.params)
    assert run.data.params["trainer.steps"] == "40"
    history = client.get_metric_history(run.info.run_id, "loss/total")
    steps = [m.step for m in history]
    assert steps == sorted(set(steps)) and steps[-1] == 40


def test_rerun_on_complete_directory_does_nothing(repo, pipeline_dir, env_with_venv):
    proc = snakemake(repo, pipeline_dir, env_with_venv, "--dry-run")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_report_renders(repo, pipeline_dir, env_with_venv):
    proc = snakemake(repo, pipeline_dir, env_with_venv, "--report", "results/report.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (pipeline_dir / "results/report.html").stat().st_size > 10_000

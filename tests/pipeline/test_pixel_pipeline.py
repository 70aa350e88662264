"""The pixel pipeline end to end on a tiny config: rendered frames -> PixelRSSM (2 DDP ranks) -> pixel-space
evaluation, pictures and MLflow records; then a run of the same config killed with SIGKILL inside a save and
resumed ends with the pipeline's (uninterrupted) digest, bit for bit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from kill_support import assert_died_of_sigkill
from pipeline_project import plan_of
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.config import paths

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.crash, pytest.mark.timeout(1500)]  # a guard: ~10 min on a loaded 2-core machine

HORIZON = 5
# Small frames and a small model keep the run in seconds; the layers are those of conf/model/pixel_rssm.yaml.
OVERRIDES = ["model.image_size=32", "model.depth=4", "model.embed=16", "model.deter=16", "model.hidden=16",
             "trainer.steps=6", "trainer.log_every=2", "checkpoint.every=2", "data.window=8", "data.stride=4"]


def tiny_config(repo: Path) -> dict:
    config = yaml.safe_load((repo / "conf/pipeline/pixels.yaml").read_text())
    dataset = config["datasets"]["pendulum_pixels"]
    dataset.update(episodes=4, max_steps=16, episodes_per_shard=2, pixel_size=32)
    dataset["heldout"] = {"episodes": 2, "seed": 1000}
    config.update(simulate_jobs=1, evaluate={"context": 3, "horizon": HORIZON})
    config["train"]["overrides"] = OVERRIDES
    return config


@pytest.fixture(scope="module")
def pixel_pipeline(repo, env_with_venv, tmp_path_factory) -> tuple[Path, object, object]:
    work = tmp_path_factory.mktemp("pixels")
    configfile = work / "pixels.yaml"
    configfile.write_text(yaml.safe_dump(tiny_config(repo)))
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(work), "--cores", "2",
           "--configfile", str(configfile)]
    proc = subprocess.run(cmd, env=env_with_venv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    datasets, runs = plan_of(repo, configfile)
    return work, datasets, runs["pendulum_pixels"]


def test_pixel_metrics_pictures_and_mlflow_records(pixel_pipeline):
    work, _, run = pixel_pipeline
    eval_dir = work / run.dir / "eval" / paths.short(run.eval_hash)
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    assert metrics["model"] == "PixelRSSM"
    for key in ("pixel_mse", "baseline_pixel_mse", "pixel_ratio", "psnr", "baseline_psnr"):
        assert len(metrics[key]) == HORIZON, key
    assert all(0 < v < 1 for v in metrics["pixel_mse"] + metrics["baseline_pixel_mse"])
    pictures = sorted(p.name for p in (eval_dir / "pictures").iterdir() if not p.name.startswith("."))
    assert pictures == ["PixelRSSM-frames-ep0.png", "PixelRSSM-frames-ep1.png",
                        "PixelRSSM-imagined-ep0.gif", "PixelRSSM-imagined-ep1.gif"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'results/mlflow.db'}")
    logged = {Path(a.path).name for a in client.list_artifacts(metrics["mlflow_run_id"], "evaluation")}
    assert set(pictures) <= logged
    # PSNR by horizon, named by horizon at the evaluated checkpoint's training step (never step = horizon).
    run_metrics = client.get_run(metrics["mlflow_run_id"]).data.metrics
    psnr = sorted(key for key in run_metrics if key.startswith("eval/per_horizon/psnr/h"))
    assert len(psnr) == HORIZON, psnr
    history = client.get_metric_history(metrics["mlflow_run_id"], psnr[0])
    assert [m.step for m in history] == [metrics["checkpoint_step"]]
    import mlflow

    mlflow.set_tracking_uri(client.tracking_uri)
    experiment = client.get_run(metrics["mlflow_run_id"]).info.experiment_id
    models = mlflow.search_logged_models(experiment_ids=[experiment], output_format="list",
                                         filter_string=f"source_run_id = '{metrics['mlflow_run_id']}'")
    assert len(models) == 1  # the pixel model is logged as an MLflow model (pyfunc over flat frames)


def test_kill9_inside_a_save_resumes_to_the_uninterrupted_digest(pixel_pipeline, env_with_venv, tmp_path):
    work, datasets, run = pixel_pipeline
    done = json.loads((work / run.dir / "train_done.json").read_text())
    data = work / datasets["pendulum_pixels"].dir
    run_dir = tmp_path / "run"
    cmd = ["worldpipe", "train", "experiment=pendulum_pixels", *OVERRIDES, f"run_dir={run_dir}",
           f"data.store={data / 'store.zarr'}", f"data.manifest={data / 'manifest.json'}", "tracking.enabled=false",
           "trainer.progress_bar=false", "parallel.nproc_per_node=2"]
    killed = subprocess.run(cmd, env={**env_with_venv, "WORLDPIPE_CKPT_FAULT": "mid_files@4:die"},
                            capture_output=True, text=True, timeout=300)
    assert_died_of_sigkill(killed, run_dir, rank=0)
    assert CheckpointManager(run_dir / "checkpoints").latest_intact() == 2
    resumed = subprocess.run(cmd, env=env_with_venv, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_digest(run_dir / "checkpoints") == done["digest"]


def test_rerun_from_records_regenerates_the_frames_and_is_bit_identical(pixel_pipeline, env_with_venv, tmp_path):
    """`worldpipe rerun` of the pipeline's recorded pixel run: the rendered dataset is gone from its recorded
    place, so it is regenerated from the recorded spec (same dataset hash) and the 2-rank training repeats
    every logged metric and the final checkpoint digest."""
    work, datasets, run = pixel_pipeline
    done = json.loads((work / run.dir / "train_done.json").read_text())
    data = work / datasets["pendulum_pixels"].dir
    hidden = data.with_name(data.name + ".away")
    data.rename(hidden)  # put back below: other tests of this module read it
    try:
        proc = subprocess.run(["worldpipe", "rerun", done["mlflow_run_id"], "--tracking-uri",
                               f"sqlite:///{work / 'results/mlflow.db'}", "--run-dir", str(tmp_path / "rerun"),
                               "--data-dir", str(tmp_path / "regenerated")],
                              env=env_with_venv, cwd=work, capture_output=True, text=True, timeout=300)
    finally:
        hidden.rename(data)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "regenerated" in proc.stdout and "bit-identical" in proc.stdout, proc.stdout[-2000:]
    assert checkpoint_digest(tmp_path / "rerun" / "checkpoints") == done["digest"]

"""The whole Snakemake DAG on the tiny config, in a fresh directory, with every real component."""

import hashlib
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline_project import bare_report, plan_of, report_clicks
from worldpipe.config import paths

# The session's docs pipelines are built in the first test's setup: past the default per-test timeout.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

METRIC_KEYS = {"model", "experiment", "checkpoint_step", "mlflow_run_id", "train_dataset_hash", "heldout_dataset_hash", "segments", "context",
               "horizon", "model_mse", "baseline_mse", "ratio", "one_step_ratio", "beats_baseline_one_step",
               # the smoke model is an RSSM: its sampled latents' open loop too
               "sampled_model_mse", "sampled_ratio", "sampled_one_step_ratio"}


def _dataset_hash(pipeline_dir: Path, dataset) -> str:
    return json.loads((pipeline_dir / dataset.dir / "manifest.json").read_text())["dataset_hash"]


def _metrics_path(pipeline_dir: Path, repo: Path) -> Path:
    _, runs = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    return pipeline_dir / RUN / "eval" / paths.short(runs["smoke"].eval_hash) / "metrics.json"


def snakemake(repo: Path, workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(repo / "conf/pipeline/smoke.yaml"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def pipeline_dir(readme_pipelines) -> Path:
    """Where the docs' smoke pipeline ran (`snakemake --cores 2 --configfile conf/pipeline/smoke.yaml`)."""
    project, _ = readme_pipelines
    return project


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
        # a state model's pictures: true vs imagined per state dimension, a band over stochastic samples
        *(f"{RUN}/eval/{paths.short(runs['smoke'].eval_hash)}/pictures/RSSM-trajectories-ep{i}.png" for i in range(4)),
        f"{RUN}/loss_curve.png",
        # the closed loop: returns with CIs, the loop's split, and (a state model) an empty pictures folder
        *(f"{RUN}/control/{paths.short(runs['smoke'].control_hash)}/{name}"
          for name in ("control.json", "returns.png", "control_loop.png", "pictures")),
        "results/mlflow.db",
    ):
        assert (pipeline_dir / rel).exists(), rel


def test_evaluation_metrics_are_complete_and_consistent(pipeline_dir, repo):
    datasets, _ = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    run = pipeline_dir / RUN
    metrics = json.loads(_metrics_path(pipeline_dir, repo).read_text())
    record = json.loads((run / "train_done.json").read_text())
    assert set(metrics) == METRIC_KEYS
    assert (metrics["context"], metrics["horizon"]) == (4, 8)  # conf/pipeline/smoke.yaml
    assert (metrics["model"], metrics["experiment"]) == ("RSSM", "smoke")
    assert metrics["checkpoint_step"] == record["final_step"] == 40
    assert metrics["mlflow_run_id"] == record["mlflow_run_id"]
    assert metrics["train_dataset_hash"] == _dataset_hash(pipeline_dir, datasets["pendulum"]) == record["dataset_hash"]
    assert metrics["heldout_dataset_hash"] == _dataset_hash(pipeline_dir, datasets["pendulum-heldout"])
    assert metrics["heldout_dataset_hash"] != metrics["train_dataset_hash"]
    assert isinstance(metrics["segments"], int) and metrics["segments"] > 0
    for key in ("model_mse", "baseline_mse", "ratio", "sampled_model_mse", "sampled_ratio"):
        assert len(metrics[key]) == 8 and all(math.isfinite(v) and v > 0 for v in metrics[key]), key
    for model, baseline, ratio in zip(metrics["model_mse"], metrics["baseline_mse"], metrics["ratio"], strict=True):
        assert ratio == pytest.approx(model / baseline, rel=1e-12)
    assert metrics["one_step_ratio"] == metrics["ratio"][0]
    assert metrics["sampled_one_step_ratio"] == metrics["sampled_ratio"][0]
    for sampled, baseline, ratio in zip(metrics["sampled_model_mse"], metrics["baseline_mse"], metrics["sampled_ratio"],
                                        strict=True):
        assert ratio == pytest.approx(sampled / baseline, rel=1e-12)
    assert metrics["beats_baseline_one_step"] is (metrics["ratio"][0] < 1.0)


def test_trained_model_beats_the_untrained_one(pipeline_dir, repo, tmp_path):
    """Same architecture, seed and normalization, no training: its held-out error one step ahead and averaged
    over the horizon must be worse than the trained checkpoint's, evaluated by the same code."""
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.evaluate.open_loop import evaluate
    from worldpipe.models import build_model

    datasets, _ = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    run, data = pipeline_dir / RUN, pipeline_dir / datasets["pendulum-heldout"].dir
    trained = CheckpointManager(run / "checkpoints").load()
    config = trained["identity"]["config"]
    torch.manual_seed(config["seed"])  # the trainer's initialization
    obs_dim = trained["model"]["obs_mean"].numel()
    act_dim = json.loads((data / "manifest.json").read_text())["arrays"]["action"]["shape"][-1]
    model = build_model(config["model"], obs_dim, act_dim)
    model.set_normalization(trained["model"]["obs_mean"], trained["model"]["obs_std"])
    untrained = dict(trained, model=model.state_dict(), optimizer=None, scheduler=None)
    CheckpointManager(tmp_path / "untrained").save(0, untrained)

    kwargs = {"store_url": str(data / "store.zarr"), "manifest_path": str(data / "manifest.json"), "context": 4,
              "horizon": 8}
    before = evaluate(str(tmp_path / "untrained"), **kwargs)
    after = evaluate(str(run / "checkpoints"), **kwargs)
    assert after["model_mse"] == json.loads(_metrics_path(pipeline_dir, repo).read_text())["model_mse"]
    assert before["baseline_mse"] == after["baseline_mse"]
    assert after["model_mse"][0] < before["model_mse"][0], (after["model_mse"], before["model_mse"])
    assert sum(after["model_mse"]) < sum(before["model_mse"]), (after["model_mse"], before["model_mse"])


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

    from worldpipe.config.identity import flatten
    from worldpipe.tracking.records import split_params

    record = json.loads((pipeline_dir / "results/runs/smoke/latest/train_done.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{pipeline_dir / 'results/mlflow.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    identity_file = client.download_artifacts(run.info.run_id, "identity.json", str(tmp_path))
    config = json.loads(Path(identity_file).read_text())["config"]
    flat = flatten(config)
    fitting, _ = split_params(flat)
    assert run.data.params == fitting  # every key, nothing else, values as logged
    assert run.data.params["trainer.steps"] == "40"
    history = client.get_metric_history(run.info.run_id, "loss/total")
    steps = [m.step for m in history]
    assert steps == sorted(set(steps)) and steps[-1] == 40


def test_every_mlflow_run_the_pipeline_opened_has_ended(pipeline_dir):
    """Training, evaluation and control runs alike: FINISHED with an end time (the UI shows a duration, not a
    spinner), read through the MLflow client as a user's UI would."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{pipeline_dir / 'results/mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert any(r.info.run_name.endswith("-control-MPPI") for r in runs)
    assert [(r.info.run_name, r.info.status) for r in runs if r.info.status != "FINISHED" or not r.info.end_time] == []


def test_the_control_score_is_in_compare_and_runs_list(pipeline_dir, env_with_venv):
    """The closed loop's score where runs are compared: `worldpipe compare --json` and `worldpipe runs list`."""
    record = json.loads((pipeline_dir / RUN / "train_done.json").read_text())
    (control,) = (pipeline_dir / RUN / paths.CONTROL_DIR).glob("*/control.json")
    result = json.loads(control.read_text())
    env = dict(env_with_venv, MLFLOW_TRACKING_URI=f"sqlite:///{pipeline_dir / 'results/mlflow.db'}")
    compare = subprocess.run(["worldpipe", "compare", "--json", record["mlflow_run_id"]], cwd=pipeline_dir, env=env,
                             capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0, compare.stderr
    section = json.loads(compare.stdout)["sections"]["control (closed loop)"]
    assert section["control/score"] == [result["score"]]
    assert section["control/planner/return_mean"] == [result["contenders"]["planner"]["mean"]]
    assert list(section)[0] == "control/score"
    listed = subprocess.run(["worldpipe", "runs", "list"], cwd=pipeline_dir, env=env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert f"score {result['score']:.3f} ({paths.CONTROL_DIR}/{control.parent.name})" in listed.stdout, listed.stdout


def test_short_run_has_several_system_metric_samples_and_progress_records(pipeline_dir):
    from mlflow.tracking import MlflowClient

    record = json.loads((pipeline_dir / RUN / "train_done.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{pipeline_dir / 'results/mlflow.db'}")
    cpu = client.get_metric_history(record["mlflow_run_id"], "system/cpu_utilization_percentage")
    # Sampled from the segment's start (ten times a second, experiment=smoke), not from when the background start
    # created the run: a run of about a second has a curve, not a single bar.
    assert len(cpu) >= 3 and max(m.value for m in cpu) > 0, [m.value for m in cpu]
    assert sorted(m.step for m in cpu) == list(range(len(cpu)))
    lines = [json.loads(line) for line in (pipeline_dir / RUN / paths.PROGRESS_RECORD).read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(5, 41, 5))  # experiment=smoke: log_every 5, 40 steps
    assert all(line["target_steps"] == 40 and line["steps_per_s"] > 0 and line["loss"] > 0 for line in lines)


def test_rerun_on_complete_directory_does_nothing(repo, pipeline_dir, env_with_venv):
    proc = snakemake(repo, pipeline_dir, env_with_venv, "--dry-run")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_report_renders_the_last_run_with_no_config_and_every_plot_two_clicks_deep(repo, pipeline_dir,
                                                                                   env_with_venv):
    # No --configfile: the report renders what the last successful run (the smoke config's) made.
    proc = bare_report(repo, pipeline_dir, env_with_venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (pipeline_dir / "results/report.html").read_text()
    clicks = report_clicks(html)
    run = (pipeline_dir / RUN).resolve().relative_to(pipeline_dir)
    figures = {Path(path).name: (depth, category, labels) for path, (depth, category, labels) in clicks.items()
               if path.startswith(str(run)) or "models_vs_baseline" in path}
    assert {"loss_curve.png", "error_vs_horizon.png", "returns.png", "control_loop.png"} <= set(figures), sorted(clicks)
    assert any("models_vs_baseline" in path for path in clicks), sorted(clicks)
    overview = [path for path in clicks if "control_overview" in path]  # the closed loop beside the open loop
    assert len(overview) == 1 and clicks[overview[0]][1] == clicks[next(p for p in clicks if "models_vs_baseline" in p)][1]
    assert "Closed loop" in html and "score" in html
    too_deep = {path: depth for path, (depth, _, _) in clicks.items() if depth > 2}
    assert not too_deep, f"plots more than two clicks deep: {too_deep}"
    for name in ("loss_curve.png", "error_vs_horizon.png", "returns.png", "control_loop.png"):
        _, category, labels = figures[name]
        assert category == "smoke" and labels["model"] == "RSSM" and labels["run"] == run.name, (name, labels)


def test_a_hand_run_of_the_pipelines_config_is_addressed_to_the_pipelines_run(pipeline_dir, repo, env_with_venv):
    """`worldpipe train experiment=smoke` by hand, in the project the pipeline trained: the same resolved config
    and dataset, so the same folder, finished already: nothing trains and nothing of the run changes."""
    datasets, runs = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    data, run = pipeline_dir / datasets["pendulum"].dir, pipeline_dir / runs["smoke"].dir
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    proc = subprocess.run(["worldpipe", "train", "experiment=smoke", f"data.store={data}/{paths.STORE_NAME}",
                           f"data.manifest={data}/{paths.MANIFEST_NAME}"], cwd=pipeline_dir, env=env_with_venv,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{runs['smoke'].dir}: this config's run, finished already" in proc.stderr, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before

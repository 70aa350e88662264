"""Collection rounds end to end: a tiny rounds pipeline (smoke model, round 0 on the scripted policy's 24 episodes,
round 1 collected by round 0's model with the planner) under real Snakemake, killed with `kill -9` in the middle of
round 1's collection and resumed; then the lineage (`worldpipe data info`, the manifest, MLflow's nested runs),
`worldpipe rerun` of round 1 from its records alone (its data played again by the recorded collecting model, the
model retrained, both bit for bit), and a raised round count that adds a round without retraining the others."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from pipeline_project import Project

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

ROUNDS = {"experiment": "smoke", "count": 1, "episodes": 12, "seed": 7000, "exploration_std": 0.15, "context": 4,
          # costly decisions on purpose: the collection of a shard lasts seconds, long enough to be killed in
          "planner": "mppi", "planner_overrides": ["samples=512", "horizon=15", "iterations=2"], "train_on": "union"}


@pytest.fixture(scope="module")
def rounds(repo, tmp_path_factory, env_with_venv):
    """The tiny rounds pipeline after a kill -9 in round 1's collection and a resumed run to the end."""
    project = Project(repo, tmp_path_factory.mktemp("rounds"), env_with_venv)
    config = yaml.safe_load((repo / "conf/pipeline/smoke.yaml").read_text())
    config.update(experiments=[], simulate_jobs=1, rounds=dict(ROUNDS))
    config["train"]["nproc_per_node"] = 1
    config["control"].update(episodes=2, max_steps=10, http_episodes=0)
    project.write_config(config)
    (dataset,) = [d for d in _planned_datasets(project) if d.name == "pendulum-round1"]
    records = project.work / dataset.dir / "parts/collected"
    first_collected = records / f"shard-{24 // 4:05d}" / "record.json"  # shards 0-5 are round 0's, copied
    proc = project.start("--rerun-incomplete")
    try:
        deadline = time.monotonic() + 900
        while not first_collected.exists():
            assert proc.poll() is None, f"the pipeline ended ({proc.returncode}) before round 1 collected a shard"
            assert time.monotonic() < deadline, "round 1 collected no shard in 15 minutes"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its collecting job, mid-round
    finally:
        proc.wait()
    written = sorted(p.name for p in records.iterdir() if (p / "record.json").exists())
    assert f"shard-{8:05d}" not in written, f"the kill came after round 1's last shard: {written}"
    assert project.snakemake("--unlock").returncode == 0  # the killed snakemake's lock on its working directory
    resumed = project.snakemake("--rerun-incomplete", timeout=1500)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return project, dataset


def _planned_datasets(project: Project):
    from worldpipe.pipeline.rounds import plan_rounds

    known, _ = project.plan()
    return [r.dataset for r in plan_rounds(project.config(), known, project.src / "conf")]


def _uri(project: Project) -> str:
    return f"sqlite:///{project.work / 'results/mlflow.db'}"


def test_a_killed_collection_resumes_its_finished_shards_and_collects_the_rest(rounds):
    project, dataset = rounds
    log = next((project.work / "logs/simulate_episodes").glob(f"pendulum-round1-{dataset.dir.rsplit('/', 1)[1]}-0.log"))
    text = log.read_text()
    assert "shard 6: collected by an earlier attempt, kept" in text, text
    assert "shard 8: 4 episodes" in text and "shard 8: collected by an earlier attempt" not in text, text
    manifest = json.loads((project.work / dataset.dir / "manifest.json").read_text())
    assert manifest["episodes"] == 24 + 12 and manifest["lineage"]["episodes"] == {"copied": 24, "collected": 12}


def test_the_lineage_shows_in_data_info_and_in_mlflow(rounds, env_with_venv):
    project, dataset = rounds
    info = subprocess.run(["worldpipe", "data", "info", dataset.dir], cwd=project.work, env=env_with_venv,
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    chain = info.stdout.split("lineage:\n", 1)[1].splitlines()
    assert chain[0].strip().startswith("round 1 (pendulum-round1): 12 episodes collected by the model of "
                                       "results/runs/smoke/"), chain
    assert chain[1].strip().startswith("round 0 (pendulum): 24 episodes of the scripted policy"), chain
    (summary_file,) = (project.work / "results/rounds").glob("*/rounds.json")
    summary = json.loads(summary_file.read_text())
    assert [row["round"] for row in summary["rounds"]] == [0, 1]
    assert summary["rounds"][1]["lineage"]["collector"]["mlflow_run_id"] == summary["rounds"][0]["mlflow_run_id"]
    assert (summary_file.parent / "return_vs_round.png").stat().st_size > 0

    from worldpipe.tracking.connection import client_for

    client = client_for(_uri(project))
    parent = client.get_run(summary["mlflow_parent_run_id"])
    for row in summary["rounds"]:
        run = client.get_run(row["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["worldpipe.round"] == str(row["round"])
    returns = client.get_metric_history(parent.info.run_id, "rounds/return_mean")
    assert [(m.step, m.value) for m in sorted(returns, key=lambda m: m.step)] == [
        (row["round"], pytest.approx(row["return_mean"])) for row in summary["rounds"]]


def test_a_round_reruns_from_its_records_bit_for_bit_rebuilding_a_missing_ancestor(rounds, env_with_venv, tmp_path):
    """Round 1's run again from MLflow, with round 0's run gone from disk: without --chain one line names it; with
    --chain round 0 is rebuilt from its own record at its address (bit-identical), then round 1's data is played
    again by it (uninterrupted, so equal to the killed-and-resumed collection) and round 1 retrained."""
    project, dataset = rounds
    (summary_file,) = (project.work / "results/rounds").glob("*/rounds.json")
    summary = json.loads(summary_file.read_text())
    round0, round1 = summary["rounds"][0], summary["rounds"][1]
    original = project.work / round0["run_dir"]
    aside = original.with_name(original.name + ".aside")
    original.rename(aside)
    command = ["worldpipe", "rerun", round1["mlflow_run_id"], "--tracking-uri", _uri(project), "--regenerate-data",
               "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run")]
    try:
        refused = subprocess.run(command, cwd=project.work, env=env_with_venv, capture_output=True, text=True,
                                 timeout=600)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]  # beside the INFO progress
        assert "Traceback" not in refused.stderr
        assert f"was collected by the model of {round0['run_dir']}, which is not here" in refused.stderr
        assert f"worldpipe rerun {round0['mlflow_run_id']}), or pass --chain" in refused.stderr

        chained = subprocess.run([*command[:-4], "--data-dir", str(tmp_path / "data2"), "--run-dir",
                                  str(tmp_path / "run2"), "--chain"], cwd=project.work, env=env_with_venv,
                                 capture_output=True, text=True, timeout=900)
        assert chained.returncode == 0, chained.stdout[-2000:] + chained.stderr[-3000:]
        assert f"rebuilding it from MLflow run {round0['mlflow_run_id']}" in chained.stdout, chained.stdout
        assert chained.stdout.count("bit-identical") == 2 and "(regenerated)" in chained.stdout, chained.stdout
        rebuilt = json.loads((original / "train_done.json").read_text())
        assert rebuilt["digest"] == round0["checkpoint_digest"]
    finally:  # the pipeline's own round 0 back in place (its files' times included)
        if original.exists():
            shutil.rmtree(original)
        aside.rename(original)


def test_a_missing_collecting_model_is_named_in_one_line(rounds, env_with_venv, tmp_path):
    project, dataset = rounds
    spec = json.loads((project.work / dataset.dir / "manifest.json").read_text())["spec"]
    spec["collector"]["run_hash"] = "0" * 64  # a collecting run that never trained here
    proc = subprocess.run(["worldpipe", "data", "init", "--spec", json.dumps(spec), "--store",
                           str(tmp_path / "store.zarr")], cwd=project.work, env=env_with_venv,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "round 1 of pendulum collects with the model of results/runs/smoke/000000000000, which has not " \
           "finished training" in proc.stderr, proc.stderr


def test_a_second_collection_of_the_same_shards_is_refused_naming_the_first(rounds, env_with_venv):
    from worldpipe.launch.run_lock import RunLock

    project, dataset = rounds
    spec = json.loads((project.work / dataset.dir / "manifest.json").read_text())["spec"]
    before = (project.work / dataset.dir / "manifest.json").read_bytes()
    with RunLock(project.work / dataset.dir / "parts/collected/shard-00007"):  # as a collecting job holds it
        proc = subprocess.run(["worldpipe", "data", "write", "--spec", json.dumps(spec), "--store",
                               f"{dataset.dir}/store.zarr", "--shards", "6:9"], cwd=project.work, env=env_with_venv,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "collection shard" in proc.stderr and f"shard-00007 is in use by pid {os.getpid()}" in proc.stderr
    verified = subprocess.run(["worldpipe", "data", "verify", dataset.dir], cwd=project.work, env=env_with_venv,
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout[-2000:]  # nothing was written
    assert (project.work / dataset.dir / "manifest.json").read_bytes() == before


def test_a_raised_round_count_adds_a_round_and_retrains_nothing_else(rounds):
    project, _ = rounds
    config = project.config()
    config["rounds"]["count"] = 2
    project.write_config(config)
    try:
        dry = project.snakemake("-n", "--rerun-incomplete", timeout=600)
    finally:
        config["rounds"]["count"] = 1
        project.write_config(config)
    assert dry.returncode == 0, dry.stderr[-3000:]
    stats = dry.stdout.split("Job stats:", 1)[1].split("Reasons:", 1)[0]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", stats, flags=re.MULTILINE))
    # round 2 only: its data (one part), its run and evaluations, the summary again
    assert jobs == {"init_store": "1", "simulate_episodes": "1", "seal_dataset": "1", "train_model": "1",
                    "evaluate_model": "1", "evaluate_control": "1", "summarize_rounds": "1", "all": "1",
                    "total": "8"}, dry.stdout[-3000:]
    assert "results/data/pendulum-round2/" in dry.stdout

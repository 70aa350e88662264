"""The loop from scratch end to end under real Snakemake, in miniature: a round 0 of random actions and one round
collected by the planner with round 0's model, warm-started from its weights, then the loop's summary (real env
steps, the wall-clock split per round from the rules' benchmarks) - the default tier. The slow tier adds a second
loop seed to the same project: time to quality across the loops with MLflow's step axis in env steps, and a
warm-started round rerun from its records alone, bit for bit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline_project import Project
from worldpipe.data.store import TrajectoryStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

EXPERIMENT = """# @package _global_
experiment_name: scratch_smoke
data:
  name: pendulum_random
  window: 8
  stride: 4
model:
  embed: 16
  deter: 16
  stoch: 4
  hidden: 32
trainer:
  steps: 30
  batch_size: 8
  warmup_steps: 5
  log_every: 5
checkpoint:
  every: 10
"""

VALUE = {"method": "actor_critic", "states": 64, "fit_steps": 20, "batch": 16, "hidden": 16}


@pytest.fixture(scope="module")
def scratch(repo, tmp_path_factory, env_with_venv):
    project = Project(repo, tmp_path_factory.mktemp("scratch"), env_with_venv)
    (project.src / "conf/experiment/scratch_smoke.yaml").write_text(EXPERIMENT)
    config = yaml.safe_load((repo / "conf/pipeline/from_scratch.yaml").read_text())
    config["datasets"]["pendulum_random"].update(episodes=2, max_steps=20, episodes_per_shard=2,
                                                 heldout={"episodes": 2, "seed": 1000})
    config["evaluate"] = {"context": 4, "horizon": 8}
    config["control"].update(episodes=2, max_steps=20, context=4, planner_overrides=["samples=16", "horizon=5"],
                             ceiling_overrides=["samples=16"])
    # With the novelty bonus, so that its path runs end to end too (and, in the slow tier, reruns to the bit).
    config["rounds"].update(experiment="scratch_smoke", budget_steps=60, episodes=1, context=4, loop_seeds=[0],
                            planner_overrides=["samples=16", "horizon=5"], novelty_bonus=0.5, novelty_reference=32)
    config["value"] = VALUE  # and with a terminal value, for collection and the closed loop alike
    project.write_config(config)
    done = project.snakemake(timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return project


@pytest.fixture(scope="module")
def two_loops(scratch):
    """The same project with a second loop seed: loop 0's jobs are done, only loop 1's and the summary across the
    loops run."""
    config = scratch.config()
    config["rounds"]["loop_seeds"] = [0, 1]
    scratch.write_config(config)
    done = scratch.snakemake(timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return scratch


def _uri(project: Project) -> str:
    return f"sqlite:///{project.work / 'results/mlflow.db'}"


def _summaries(project: Project) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((project.work / "results/rounds").glob("*/rounds.json"))]


def test_each_loop_counts_its_real_steps_and_times_each_round_by_part(scratch):
    summaries = _summaries(scratch)
    assert summaries, "no loop summary"
    for summary in summaries:  # one loop, or two once the slow tier's second loop ran
        assert summary["behaviour_is_random"] and summary["behaviour_policy"] == "random"
        assert [row["env_steps"] for row in summary["rounds"]] == [40, 60]
        for row in summary["rounds"]:
            clock = row["wall_clock_s"]
            assert all(clock[part] > 0 for part in ("collection", "training", "evaluation")), clock
        first, second = summary["rounds"]
        assert second["loop_wall_clock_s"] == pytest.approx(
            first["loop_wall_clock_s"] + second["wall_clock_s"]["collection"] + second["wall_clock_s"]["training"])
        assert second["lineage"]["episodes"] == {"copied": 2, "collected": 1}
        # What each round's episodes earned in the real env: round 0's two random ones, then the planner's one.
        assert [len(row["collected_returns"]) for row in summary["rounds"]] == [2, 1]
        (manifest,) = [path for path in (scratch.work / "results/data").glob("*-round1/*/manifest.json")
                       if json.loads(path.read_text())["dataset_hash"] == second["dataset_hash"]]
        arrays = TrajectoryStore.open(str(manifest.with_name("store.zarr"))).read_episodes(2, 3)
        played = float(arrays["reward"][0, :arrays["length"][0]].sum(dtype=np.float64))
        assert second["collected_returns"] == [pytest.approx(played, abs=1e-6)] and played < 0  # Pendulum-v1's costs


def test_the_rounds_share_one_evaluation_of_the_model_free_contenders(scratch):
    """Random actions, the behaviour policy and the ceiling do not use a round's model: the loop's rounds take them
    from one `evaluate_references` job (its seed's) instead of playing them again each round."""
    (references,) = (scratch.work / "results/control/references").glob("*/seed-0.json")
    played = json.loads(references.read_text())["contenders"]
    records = [record for record in (scratch.work / "results/runs/scratch_smoke").glob("*/control/*/control.json")
               if not record.parents[2].is_symlink()]  # not through `latest`
    assert len(records) == 2  # loop 0's two rounds
    for record in map(json.loads, map(Path.read_text, records)):
        assert record["run_seed"] == 0
        for name in ("random", "behaviour", "ceiling"):
            contender = record["contenders"][name]
            assert (contender["returns"], contender["actions_sha256"]) == (
                played[name]["returns"], played[name]["actions_sha256"]), name


def test_collection_and_the_closed_loop_plan_with_the_configs_value_written_out_in_full(scratch):
    from worldpipe.config.value import value_settings

    full = value_settings(VALUE, "value")
    (manifest,) = (scratch.work / "results/data").glob("*-round1/*/manifest.json")
    assert json.loads(manifest.read_text())["spec"]["collector"]["value"] == full
    records = [json.loads(record.read_text())
               for record in (scratch.work / "results/runs/scratch_smoke").glob("*/control/*/control.json")]
    assert records and all(r["settings"]["value"] == full and r["value_fit_s"] > 0 for r in records)
    # Round 0's model plans round 1's collection and its own closed loop with one value, fitted once.
    runs = [run for run in (scratch.work / "results/runs/scratch_smoke").iterdir() if not run.is_symlink()]
    assert sorted(len(list((run / "value").glob("value-*.pt"))) for run in runs) == [1, 1], runs
    (references,) = (scratch.work / "results/control/references").glob("*/seed-0.json")
    assert json.loads(references.read_text())["settings"]["value"] == full  # the same settings, checked


def test_a_round_starts_from_the_previous_rounds_weights(scratch):
    from worldpipe.evaluate.open_loop import load_model

    for summary in _summaries(scratch):
        first, second = summary["rounds"]
        _, identity = load_model(str(scratch.work / second["run_dir"] / "checkpoints"))
        assert identity["warm_start"]["digest"] == first["checkpoint_digest"]
        assert identity["warm_start"]["run_dir"] == first["run_dir"]
        assert identity["config"]["init_from"].startswith("scratch_smoke/")


@pytest.mark.slow
def test_time_to_quality_summarises_the_loops_with_env_steps_on_mlflows_step_axis(two_loops):
    scratch = two_loops
    summaries = _summaries(scratch)
    # the loops differ in their seeds: other random episodes, other models
    assert len(summaries) == 2 and summaries[0]["rounds"][0]["dataset_hash"] != summaries[1]["rounds"][0]["dataset_hash"]
    (ttq_file,) = (scratch.work / "results/rounds").glob("loops-*/time_to_quality.json")
    ttq = json.loads(ttq_file.read_text())
    assert len(ttq["loops"]) == 2 and [row["env_steps_median"] for row in ttq["rounds"]] == [40, 60]
    assert [a["agent"] for a in ttq["anchors"]][:3] == ["TD3", "SAC", "PPO"]
    assert (ttq_file.parent / "time_to_quality.png").read_bytes()[:4] == b"\x89PNG"

    from worldpipe.tracking.connection import client_for

    client = client_for(_uri(scratch))
    history = client.get_metric_history(ttq["mlflow_parent_run_id"], "time_to_quality/return_median")
    assert sorted((m.step, m.value) for m in history) == [
        (row["env_steps_median"], pytest.approx(row["return"]["median"])) for row in ttq["rounds"]]
    for summary in summaries:
        parent = client.get_run(summary["mlflow_parent_run_id"])
        assert parent.data.tags["mlflow.parentRunId"] == ttq["mlflow_parent_run_id"]
        steps = client.get_metric_history(parent.info.run_id, "env_steps/return_mean")
        assert sorted(m.step for m in steps) == [40, 60]


@pytest.mark.slow
def test_a_warm_started_round_reruns_from_its_records_bit_for_bit(scratch, env_with_venv, tmp_path):
    summary = _summaries(scratch)[0]
    second = summary["rounds"][1]
    proc = subprocess.run(["worldpipe", "rerun", second["mlflow_run_id"], "--tracking-uri", _uri(scratch),
                           "--run-dir", str(tmp_path / "rerun")], cwd=scratch.work, env=env_with_venv,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bit-identical" in proc.stdout, proc.stdout


def test_a_warm_start_from_a_run_that_never_finished_is_one_line(scratch, env_with_venv, tmp_path):
    (data,) = (scratch.work / "results/data/pendulum_random").iterdir()
    proc = subprocess.run(["worldpipe", "train", "experiment=scratch_smoke", f"+init_from=scratch_smoke/{'0' * 64}",
                           f"data.store={data}/store.zarr", f"data.manifest={data}/manifest.json",
                           f"run_dir={tmp_path / 'run'}", "parallel.nproc_per_node=1", "tracking.enabled=false"],
                          cwd=scratch.work, env={**env_with_venv, "WORLDPIPE_CONF_DIR": str(scratch.src / "conf")},
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == ("error: config key 'init_from': results/runs/scratch_smoke/000000000000 has not finished "
                        "training (results/runs/scratch_smoke/000000000000/train_done.json is missing); train it "
                        "first (a rounds pipeline trains round k-1 before round k)")

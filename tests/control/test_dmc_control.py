"""DeepMind Control from state, end to end with the real commands: a cartpole-swingup dataset of random actions into
a zarr store (its observation key order and action repeat in the sealed manifest), a model trained on it under
torchrun, and the closed loop in the real env beside random and the planner with MuJoCo as its true simulator."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SPEC = {"name": "cartpole_swingup", "env_id": "dm_control/cartpole-swingup-v0", "policy": "random", "episodes": 4,
        "max_steps": 25, "episodes_per_shard": 2, "seed": 0, "action_repeat": 8,
        "observation_keys": ["velocity", "position"]}


def _run(args: list[str], cwd, env, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, env_with_venv):
    root = tmp_path_factory.mktemp("dmc")
    store, manifest = root / "store.zarr", root / "manifest.json"
    spec = json.dumps(SPEC)
    _run(["worldpipe", "data", "init", "--spec", spec, "--store", str(store)], root, env_with_venv)
    for shards in ("0:1", "1:2"):
        _run(["worldpipe", "data", "write", "--spec", spec, "--store", str(store), "--shards", shards], root,
             env_with_venv)
    _run(["worldpipe", "data", "seal", "--store", str(store), "--manifest", str(manifest)], root, env_with_venv)
    return root, store, manifest


def test_a_dmc_episode_round_trips_through_the_store_with_its_key_order(dataset):
    from worldpipe.data.episodes import simulate_episode
    from worldpipe.data.manifest import load_manifest
    from worldpipe.data.spec import DatasetSpec
    from worldpipe.data.store import TrajectoryStore

    _, store, manifest = dataset
    recorded = load_manifest(str(manifest))
    assert recorded["spec"]["observation_keys"] == ["velocity", "position"]
    assert recorded["spec"]["action_repeat"] == 8 and recorded["steps"] == 4 * 25
    episodes = TrajectoryStore.open(str(store), recorded).read_episodes(0, 4)
    assert episodes["obs"].shape == (4, 25, 5)
    expected = simulate_episode(DatasetSpec.from_dict(SPEC), 3)
    np.testing.assert_array_equal(episodes["obs"][3], expected.obs)
    np.testing.assert_array_equal(episodes["reward"][3], expected.reward)


def test_a_model_trained_on_it_plans_in_the_real_env_beside_random_and_the_mujoco_ceiling(dataset, env_with_venv):
    root, store, manifest = dataset
    run = root / "run"
    _run(["worldpipe", "train", "experiment=smoke", f"data.store={store}", f"data.manifest={manifest}",
          "data.name=cartpole_swingup", f"run_dir={run}", "parallel.nproc_per_node=1", "tracking.enabled=false",
          "trainer.steps=20", "data.window=8", "data.stride=4"], root, env_with_venv)
    out = root / "control.json"
    _run(["worldpipe", "control", "evaluate", "--checkpoints", str(run / "checkpoints"), "--episodes", "2",
          "--max-steps", "6", "--context", "4", "--set", "samples=16", "--set", "horizon=4", "--ceiling-set",
          "samples=32", "--no-tracking", "--out", str(out)], root, env_with_venv)
    record = json.loads(out.read_text())
    assert record["settings"]["env_id"] == "dm_control/cartpole-swingup-v0"
    assert record["settings"]["action_repeat"] == 8
    assert record["settings"]["observation_keys"] == ["velocity", "position"]
    for name in ("random", "planner", "ceiling"):
        returns = record["contenders"][name]["returns"]
        assert len(returns) == 2 and all(0.0 <= r <= 6 * 8 for r in returns), (name, returns)
    assert record["yardstick"]["best_known"]["return"] == 845.0


def test_the_yardstick_plays_the_env_the_closed_loop_plays(repo, env_with_venv, tmp_path):
    """With the training data's action repeat and observation keys (which the rule passes on), the budget curve's
    first level is the closed loop's ceiling, episode for episode (the same streams at run seed 0)."""
    dry = _run(["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(tmp_path / "wd"), "--cores", "1",
                "--configfile", str(repo / "conf/pipeline/dmc_cartpole.yaml"), "-n", "-p", "control_yardstick"],
               tmp_path, env_with_venv)
    (command,) = {line.removeprefix("Shell command: ") for line in (dry.stdout + dry.stderr).splitlines()
                  if line.startswith("Shell command: worldpipe control yardstick")}
    assert "--env-id dm_control/cartpole-swingup-v0" in command and "--episodes=5" in command
    assert "--action-repeat=8 --observation-keys=position,velocity" in command, command
    same = ["--env-id", "dm_control/cartpole-swingup-v0", "--max-steps", "3", "--episodes", "2", "--set", "samples=4",
            "--set", "iterations=1", "--set", "horizon=2", "--action-repeat", "8", "--observation-keys",
            "position,velocity"]
    _run(["worldpipe", "control", "yardstick", *same, "--levels", "2", "--out", str(tmp_path / "curve.json")],
         tmp_path, env_with_venv)
    _run(["worldpipe", "control", "references", *same, "--behaviour-policy", "random", "--run-seed", "0", "--out",
          str(tmp_path / "references.json")], tmp_path, env_with_venv)
    curve = json.loads((tmp_path / "curve.json").read_text())
    played = json.loads((tmp_path / "references.json").read_text())["contenders"]
    assert curve["env_options"] == {"action_repeat": 8, "observation_keys": ["position", "velocity"]}
    assert curve["levels"][0]["returns"] == played["ceiling"]["returns"]
    assert curve["random"]["mean"] == pytest.approx(np.mean(played["random"]["returns"]))

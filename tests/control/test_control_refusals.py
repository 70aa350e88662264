"""Issue 51: `worldpipe control evaluate` refuses what cannot work before any episode runs, in one line naming the
option and what would work (exit 2), and takes the environment and behaviour policy the run's data recorded.

`worldpipe control evaluate` on a model published as training publishes one (untrained: no refusal depends on
what it learned), standing for a model of the smoke dataset's Pendulum-v1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from worldpipe.core.errors import EXIT_USAGE
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]

TINY = ["--episodes", "1", "--max-steps", "3", "--context", "2", "--set", "horizon=2", "--set", "samples=4",
        "--set", "iterations=1", "--no-tracking"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smoke_dataset) -> dict[str, Path]:
    """A Pendulum-v1 model whose checkpoint records the smoke dataset (env and policy), and one that records none."""
    root = tmp_path_factory.mktemp("control-refusals")
    _, manifest = smoke_dataset
    publish_demo_checkpoint(root / "recorded" / "checkpoints", config={"data": {"manifest": str(manifest)}})
    publish_demo_checkpoint(root / "bare" / "checkpoints")
    return {"recorded": root / "recorded", "bare": root / "bare"}


def control(run: Path, tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["worldpipe", "control", "evaluate", str(run), "--out", str(tmp_path / "control.json"),
                           *TINY, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


CASES = {
    "unknown env": ("bare", ["--env-id", "Bogus-v9", "--behaviour-policy", "noisy_controller"],
                    ["--env-id Bogus-v9: no such Gymnasium environment", "Pendulum-v1"]),
    "unknown policy": ("recorded", ["--behaviour-policy", "bogus"],
                       ["--behaviour-policy bogus", "noisy_controller"]),
    "unknown policy, no record": ("bare", ["--env-id", "Pendulum-v1", "--behaviour-policy", "bogus"],
                                  ["--behaviour-policy bogus: Pendulum-v1 has no such policy",
                                   "policies: noisy_controller, random"]),
    "horizon 0": ("recorded", ["--set", "horizon=0"], ["'horizon=0'", "horizon must be >= 1"]),
    "cem with one sample": ("recorded", ["--planner", "cem", "--set", "samples=1"], ["samples must be >= 2"]),
    "negative http episodes": ("recorded", ["--http-episodes", "-1"], ["--http-episodes -1: must be >= 0"]),
    "no episodes": ("recorded", ["--episodes", "0"], ["--episodes 0: must be >= 1"]),
    "unknown planner": ("recorded", ["--planner", "bogus"], ["no planner 'bogus'", "cem, mppi"]),
    "another model's env": ("bare", ["--env-id", "MountainCarContinuous-v0", "--behaviour-policy", "random"],
                            ["MountainCarContinuous-v0: observations of 2 values, the model's of 3",
                             "the model was trained on another environment"]),
    "env against the record": ("recorded", ["--env-id", "CartPole-v1"],
                               ["--env-id CartPole-v1: the run was trained on data of env-id Pendulum-v1",
                                "manifest.json", "leave --env-id out"]),
    "policy against the record": ("recorded", ["--behaviour-policy", "random"],
                                  ["--behaviour-policy random: the run was trained on data of behaviour-policy "
                                   "noisy_controller"]),
    "no env, no record": ("bare", [], ["--env-id is needed", "records no dataset manifest"]),
    "missing run": ("missing", ["--env-id", "Pendulum-v1"], ["no such directory"]),
}


# As a real process: the first example (the rest in-process: the same code, without a start-up each).
IN_SUBPROCESS = {"unknown env"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_control_refusal_is_one_line_naming_the_option(case, runs, tmp_path, env_with_venv, capsys):
    which, args, needles = CASES[case]
    run = runs.get(which, tmp_path / "missing")
    if case in IN_SUBPROCESS:
        proc = control(run, tmp_path, env_with_venv, *args)
        code, stderr = proc.returncode, proc.stderr
    else:
        from worldpipe.cli import main

        code = main(["control", "evaluate", str(run), "--out", str(tmp_path / "control.json"), *TINY, *args])
        stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == EXIT_USAGE and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: ") and "unexpected" not in lines[0] and "Traceback" not in stderr
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not (tmp_path / "control.json").exists()  # refused before anything ran


def test_env_and_policy_default_to_the_ones_the_run_recorded(runs, tmp_path, env_with_venv):
    proc = control(runs["recorded"], tmp_path, env_with_venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = json.loads((tmp_path / "control.json").read_text())["settings"]
    assert (settings["env_id"], settings["behaviour_policy"]) == ("Pendulum-v1", "noisy_controller")

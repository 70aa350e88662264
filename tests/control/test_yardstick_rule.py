"""The yardstick's Snakemake rule: `control_yardstick` measures the ceiling's budget curve per env with the closed
loop's own seeds, episodes and planner, and every closed loop plays its ceiling at `control: ceiling_overrides`
(a real Snakemake dry run of the smoke config)."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dry_run(repo, env_with_venv, tmp_path_factory) -> str:
    """One dry run of the whole smoke pipeline and the yardstick (parsing the pipeline is most of its time)."""
    proc = subprocess.run(["snakemake", "-s", str(repo / "Snakefile"), "--directory",
                           str(tmp_path_factory.mktemp("yardstick")), "--cores", "1", "--configfile",
                           str(repo / "conf/pipeline/smoke.yaml"), "-n", "-p", "--", "all", "control_yardstick"],
                          env=env_with_venv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_the_yardstick_rule_measures_the_curve_with_the_closed_loops_settings(dry_run):
    (command,) = [line for line in dry_run.splitlines() if "worldpipe control yardstick" in line]
    for option in ("--env-id Pendulum-v1", "--max-steps=20", "--episodes=2", "--seed=5000", "--planner=mppi",
                   "--set=samples=16", "--set=horizon=5", "--set=iterations=2",
                   "--out results/control/yardstick/Pendulum-v1.json",
                   "--plot results/control/yardstick/Pendulum-v1.png"):
        assert option in command, (option, command)
    assert "--checkpoints" not in command  # no model: the curve needs no training


def test_every_closed_loop_plays_its_ceiling_at_the_recorded_budget(dry_run):
    (command,) = [line for line in dry_run.splitlines() if "worldpipe control evaluate" in line]
    assert "--ceiling-set=samples=32 --ceiling-set=iterations=4" in command, command


@pytest.mark.parametrize(("args", "needle"), [
    (["--env-id", "Bogus-v9"], "--env-id Bogus-v9: the ceiling needs the env's true simulator"),
    (["--episodes", "1"], "--episodes must be >= 2"),
])
def test_a_yardstick_it_cannot_measure_is_one_line_and_exit_2(args, needle, env_with_venv, tmp_path):
    proc = subprocess.run(["worldpipe", "control", "yardstick", *args, "--out", str(tmp_path / "curve.json")],
                          env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "unexpected" not in proc.stderr
    assert not (tmp_path / "curve.json").exists()

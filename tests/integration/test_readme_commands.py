"""Every command in the README's shell blocks runs as written, in a fresh copy of the project.

The cheap commands (no results needed, seconds) run in the default tier; the rest run in the slow tier on the
results of the README's own smoke and sweep pipelines (the session fixture ``readme_pipelines``, which the
pipeline tests read too), with the placeholders (``RUN_ID``, ``<spec-hash>``, ...) replaced by what those
pipelines made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from readme_support import project_env, readme_commands, run_in


def test_every_readme_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert len(commands) > 40, "the README parser found too few commands"
    for command in commands:
        assert command.skipped is None or command.skipped, f"README line {command.line}: a marker without a reason"
    tiers = {c.tier for c in commands}
    assert {"cheap", "setup", "slow", "skipped"} <= tiers, tiers


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_cheap_readme_commands_run_as_written(tmp_path, env_with_venv):
    project, env = project_env(tmp_path, env_with_venv)
    cheap = [c for c in readme_commands() if c.tier == "cheap"]
    assert len(cheap) >= 6
    for command in cheap:
        run_in(project, command, env, timeout=300)
    assert (project / "dag.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _substitutions(project: Path) -> dict[str, str]:
    def done(run_dir: Path) -> str:
        return json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"]

    points = sorted(p for p in (project / "results/sweeps/smoke_sweep").iterdir() if (p / "train_done.json").exists())
    parent = json.loads((project / "results/sweeps/smoke_sweep/parent.json").read_text())
    spec = {name: next((project / "results/data" / name).iterdir()).name for name in ("pendulum", "pendulum-heldout")}
    smoke = done(project / "results/runs/smoke/latest")
    return {"SWEEP_PARENT_RUN_ID": parent["run_id"], "RUN_ID_A": smoke, "RUN_ID_B": done(points[0]),
            "RUN_ID_C": done(points[1]), "RUN_ID": smoke,
            "results/data/pendulum/<spec-hash>": f"results/data/pendulum/{spec['pendulum']}",
            "results/data/pendulum-heldout/<spec-hash>": f"results/data/pendulum-heldout/{spec['pendulum-heldout']}"}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a dozen trainings on 2 cores (and the pipelines, if this test runs alone)
def test_readme_commands_on_the_smoke_pipelines_run_as_written(readme_pipelines_last_reader):
    # The shared results are changed here (new runs, `latest` moved): conftest orders this test after every
    # other reader of `readme_pipelines`.
    project, env = readme_pipelines_last_reader
    commands = readme_commands()
    substitutions = _substitutions(project)
    for command in [c for c in commands if c.tier == "slow"]:
        print(f"README line {command.line}: {command.text.splitlines()[0]}", flush=True)  # progress under -s
        run_in(project, command, env, substitutions)

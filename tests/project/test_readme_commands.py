"""Every command in the shell blocks of the README and the docs pages runs as written, in a fresh copy of the project.

A block whose commands are not run says why in an HTML comment just above it (``<!-- not run by tests: why -->``),
never in the text a reader copies. The cheap commands (no results needed, seconds) run first; the rest run in the
slow tier on the results of the docs' own smoke and sweep pipelines (the session fixture ``readme_pipelines``,
which the pipeline tests read too), with the placeholders (``RUN_ID``, ``<spec-hash>``, ...) replaced by what
those pipelines made.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from readme_support import REPO, in_run_order, pages, parse_page, project_env, readme_commands, run_in

pytestmark = pytest.mark.integration


def test_every_documented_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert len(commands) > 40, "the page parser found too few commands"
    for page in pages():
        parsed = parse_page(page)
        assert not parsed.stray_markers, f"{page} lines {parsed.stray_markers}: a skip comment not directly above a shell block"
        assert not parsed.annotated_lines, (f"{page} lines {parsed.annotated_lines}: a test annotation inside a shell "
                                            "block (put it in a comment above the block)")
        assert not parsed.indented_blocks, f"{page} lines {parsed.indented_blocks}: an indented shell block is not parsed"
    for command in commands:
        assert command.skipped is None or command.skipped, f"{command.where}: a skip comment without a reason"
    tiers = {c.tier for c in commands}
    assert {"cheap", "setup", "slow", "skipped"} <= tiers, tiers


def test_ci_runs_the_readme_test_command():
    quick = [c for c in readme_commands() if c.page == "README.md"]
    assert [c.text for c in quick] == ["make pipeline", "make test"], "the README's quick start is its two commands"
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert shlex.split(ci[-1]) == ["make", "test"], f".ci/run ends with {ci[-1]!r}, not the README's test command"


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_cheap_readme_commands_run_as_written(tmp_path, env_with_venv):
    project, env = project_env(tmp_path, env_with_venv)
    cheap = [c for c in in_run_order(readme_commands()) if c.tier == "cheap"]
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
    commands = in_run_order(readme_commands())
    substitutions = _substitutions(project)
    for command in [c for c in commands if c.tier == "slow"]:
        print(f"{command.where}: {command.text.splitlines()[0]}", flush=True)  # progress under -s
        run_in(project, command, env, substitutions)

"""Every figure the README and the docs show names the runs it was drawn from, and those are the current config's.

A figure under docs/assets/ has a JSON file beside it (written with it by `worldpipe figures`) naming the command,
the pipeline config, every run (experiment and run hash) and the numbers drawn. Here the committed files are held
to the config as it is now: a figure whose runs or evaluations the config no longer plans (a changed default,
dataset, model or closed-loop setting) is stale and fails. Its numbers are held to a fresh run's by tests/pipeline/test_default_pipeline.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from worldpipe.commands.figures import CLOSED_LOOP_FIGURE
from worldpipe.pipeline.plan import plan

REPO = Path(__file__).resolve().parents[2]
SHOWN = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")


def _shown_figures() -> list[Path]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {(page.parent / link).resolve() for page in pages for link in SHOWN.findall(page.read_text())}
    return sorted(found)


def test_the_docs_show_figures():
    assert {p.name for p in _shown_figures()} >= {"models-vs-baseline.png", "control-overview.png"}


@pytest.mark.parametrize("figure", _shown_figures(), ids=lambda p: p.name)
def test_a_shown_figure_names_the_current_configs_runs(figure: Path):
    record_path = figure.with_suffix(".json")
    assert figure.is_file(), f"{figure} is shown but not committed"
    assert record_path.is_file(), f"{figure.name} has no {record_path.name}: make it with `worldpipe figures`"
    record = json.loads(record_path.read_text())
    if "loops" in record:  # time to quality across loop seeds (`worldpipe rounds time-to-quality --docs`)
        _check_loops_figure(figure, record)
        return
    assert record["command"].startswith("worldpipe ") and record["runs"] and record["values"]
    assert set(record["values"]) == set(record["runs"])
    _, runs = plan(yaml.safe_load((REPO / record["config"]).read_text()), REPO / "conf")
    closed_loop = figure.stem == CLOSED_LOOP_FIGURE
    planned = {name: (run.run_hash[:12], (run.control_hash if closed_loop else run.eval_hash)[:12])
               for name, run in runs.items() if name in record["runs"]}
    drawn = {name: (entry["run_hash"], entry["evaluation_hash"]) for name, entry in record["runs"].items()}
    assert drawn == planned, (f"{figure.name} was drawn from (run, evaluation) {drawn}, the config now plans "
                              f"{planned}: run "
                              f"`make pipeline` and `{record['command']}` again")
    for entry in record["runs"].values():
        assert entry["mlflow_run_id"] and entry["checkpoint_digest"] and entry["numerics"]


def _check_loops_figure(figure: Path, record: dict) -> None:
    """Every loop's runs and closed-loop evaluations drawn are the ones the recorded config plans now."""
    from worldpipe.pipeline.rounds import plan_loops

    assert record["command"].startswith("worldpipe rounds time-to-quality ") and record["values"]["rounds"]
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config.update(yaml.safe_load((REPO / record["config"]).read_text()))
    known, _ = plan(config, REPO / "conf")
    planned = {(r.run.run_hash[:12], r.run.control_hash[:12]) for found in plan_loops(config, known, REPO / "conf")
               for r in found}
    drawn = {(row["run_hash"], row["control_hash"]) for loop in record["loops"] for row in loop}
    assert drawn <= planned, (f"{figure.name} was drawn from runs {sorted(drawn - planned)} that {record['config']} no "
                              f"longer plans: run its pipeline and `{record['command']}` again")
    for loop in record["loops"]:
        for row in loop:
            assert row["mlflow_run_id"] and row["checkpoint_digest"]

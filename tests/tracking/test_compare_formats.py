"""`worldpipe compare`'s three renderings of one comparison: values whole in the table, the same in JSON and CSV.

The runs are plain stand-ins with MLflow's Run shape (info, data.params/metrics/tags): what is tested is the
rendering, not MLflow (tests/tracking/test_tracking_comparison.py compares real runs)."""

from __future__ import annotations

import csv
import io
import json
from types import SimpleNamespace

from worldpipe.tracking.comparison import Comparison, comparison_csv, comparison_json, comparison_table

LONG = "worldpipe.models.rssm.RSSM-with-a-long-target-name-that-a-28-column-table-used-to-cut"


def _run(run_id: str, target: str, cbwr: str, loss: float):
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id, run_name=f"name-{run_id}"),
                           data=SimpleNamespace(params={"model._target_": target, "seed": "0"},
                                                metrics={"loss/total": loss},
                                                tags={"worldpipe.numerics.mkl.cbwr": cbwr}))


def _comparison() -> Comparison:
    return Comparison([_run("a" * 32, LONG, "AUTO", 1.5), _run("b" * 32, "short", "AVX2", 1.25)], [])


def test_the_table_prints_every_differing_value_whole():
    table = comparison_table(_comparison())
    assert LONG in table and "…" not in table
    assert "worldpipe.numerics.mkl.cbwr" in table and "AVX2" in table


def test_json_and_csv_carry_the_same_sections_and_values():
    data = json.loads(comparison_json(_comparison()))
    assert [r["run_id"] for r in data["runs"]] == ["a" * 32, "b" * 32]
    assert data["sections"]["param differences"] == {"model._target_": [LONG, "short"]}
    assert data["sections"]["identity differences"]["worldpipe.numerics.mkl.cbwr"] == ["AUTO", "AVX2"]
    rows = list(csv.reader(io.StringIO(comparison_csv(_comparison()))))
    assert rows[0] == ["section", "key", "a" * 32, "b" * 32]
    assert ["param differences", "model._target_", LONG, "short"] in rows
    assert ["training (final)", "loss/total", "1.5", "1.25"] in rows


def test_the_closed_loop_has_its_own_section_score_first_in_every_rendering():
    runs = [_run("a" * 32, "short", "AUTO", 1.5), _run("b" * 32, "short", "AUTO", 1.25)]
    for run, (score, mean) in zip(runs, [(0.91, -273.9), (0.995, -185.2)], strict=True):
        run.data.metrics.update({"control/planner/return_mean": mean, "control/planner/return_ci95_low": mean - 50,
                                 "control/ceiling_score": 0.99, "control/score": score,
                                 "control/random/return_mean": -1270.2, "control/planner/return": mean})
    comparison = Comparison(runs, [])
    section = json.loads(comparison_json(comparison))["sections"]["control (closed loop)"]
    assert list(section)[:3] == ["control/score", "control/ceiling_score", "control/planner/return_ci95_low"]
    assert section["control/score"] == [0.91, 0.995] and "control/planner/return" not in section
    assert "control (closed loop)" in comparison_table(comparison) and "0.995" in comparison_table(comparison)
    assert ["control (closed loop)", "control/score", "0.91", "0.995"] in list(
        csv.reader(io.StringIO(comparison_csv(comparison))))


def test_a_reference_to_a_missing_file_is_one_line_and_opens_no_store(tmp_path, monkeypatch, capsys):
    from worldpipe.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["compare", str(tmp_path / "gone" / "train_done.json")]) == 2
    assert "train_done.json: no such file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no results/mlflow.db made for a comparison that cannot start

"""`worldpipe bench startup` through the CLI, one round: the synchronous MLflow run start (before) and the
background one (after) side by side, with their breakdowns. Structure of the JSON only: benchmarks measure
speed, tests never assert on it."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # seven real training launches: a minute or more

CONTENDERS = {"bare script", "torchrun", "in-process", "in-process, sync run start", "in-process, resume",
              "in-process, tracking off"}


def test_bench_startup_shows_the_sync_and_background_run_start_side_by_side(tmp_path, env_with_venv):
    out = tmp_path / "bench" / "startup.json"
    proc = subprocess.run(["worldpipe", "bench", "startup", "--repeats", "1", "--out", str(out)], env=env_with_venv,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    contenders = report["contenders"]
    assert set(contenders) == CONTENDERS
    assert len(report["machine"]["load_average"]) == 3
    for name, c in contenders.items():
        assert len(c["all_runs_s"]) == 1 and c["first_step_s"] == c["all_runs_s"][0], name
        # The breakdown's spans add up to the time to the first step of the run it describes.
        assert sum(c["breakdown_s"].values()) == pytest.approx(c["first_step_s"]), name
    for name in ("in-process", "in-process, sync run start"):
        assert contenders[name]["mlflow_on_critical_path_s"] is not None
        assert "mlflow_run_opened" in contenders[name]["delivery_thread_events_s"], name
    assert "mlflow_run_opened" not in contenders["in-process, tracking off"]["delivery_thread_events_s"]
    span = report["mlflow_on_critical_path_s"]
    assert span == {"sync": contenders["in-process, sync run start"]["mlflow_on_critical_path_s"],
                    "background": contenders["in-process"]["mlflow_on_critical_path_s"]}
    assert report["background_start_saves_s"] == pytest.approx(
        contenders["in-process, sync run start"]["first_step_s"] - contenders["in-process"]["first_step_s"])
    assert "MLflow on the critical path" in proc.stdout and out.with_suffix(".png").stat().st_size > 0

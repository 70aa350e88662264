"""A single-process run trains inside the launcher (no torchrun) and ends with the same bits as under torchrun."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def train_cmd(run_dir: Path, dataset, *extra: str) -> list[str]:
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke", "parallel=single", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false", *extra]


def traced(run_dir: Path, dataset, env: dict, launcher: str | None, *extra: str) -> list[dict]:
    trace = run_dir.parent / f"{run_dir.name}.trace"
    env = {**env, "WORLDPIPE_STARTUP_TRACE": str(trace)}
    if launcher:
        env["WORLDPIPE_LAUNCHER"] = launcher
    proc = subprocess.run(train_cmd(run_dir, dataset, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in trace.read_text().splitlines()]


def test_in_process_run_equals_torchrun_run(tmp_path, smoke_dataset, env_with_venv):
    local = traced(tmp_path / "local", smoke_dataset, env_with_venv, None, "trainer.steps=6", "checkpoint.every=3")
    spawned = traced(tmp_path / "spawned", smoke_dataset, env_with_venv, "torchrun", "trainer.steps=6",
                     "checkpoint.every=3")
    events = [e["event"] for e in local]
    assert "torchrun_spawned" not in events and "first_step_done" in events
    assert len({e["pid"] for e in local}) == 1  # launcher and trainer are one process
    assert "torchrun_spawned" in [e["event"] for e in spawned] and len({e["pid"] for e in spawned}) == 2
    # The launcher composes and validates once; torchrun's worker trains its record without checking it again.
    for trace in (local, spawned):
        launcher = next(e["pid"] for e in trace if e["event"] == "launcher_start")
        assert [e["pid"] for e in trace if e["event"] == "config_validated"] == [launcher]
    done = [json.loads((tmp_path / name / "train_done.json").read_text()) for name in ("local", "spawned")]
    assert done[0]["final_step"] == done[1]["final_step"] == 6
    assert done[0]["digest"] == done[1]["digest"]
    for name in ("local", "spawned"):
        assert (tmp_path / name / "hydra" / "config.yaml").exists()
        assert (tmp_path / name / "hydra" / "overrides.yaml").exists()


def test_in_process_run_preempts_with_75_and_resumes_to_the_same_bits(tmp_path, smoke_dataset, env_with_venv):
    steps = ("trainer.steps=400", "checkpoint.every=2")
    reference = traced(tmp_path / "reference", smoke_dataset, env_with_venv, None, *steps)
    assert reference
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(run_dir, smoke_dataset, *steps), env=env_with_venv,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert (run_dir / "PREEMPTED").exists()
    traced(run_dir, smoke_dataset, env_with_venv, None, *steps)
    digests = [json.loads((tmp_path / n / "train_done.json").read_text())["digest"] for n in ("reference", "run")]
    assert digests[0] == digests[1]

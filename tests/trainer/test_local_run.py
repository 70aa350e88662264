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
    assert "torchrun_spawned" in [e["event"] for e in spawned]
    assert len({e["pid"] for e in spawned if e["event"] != "torchrun_main"}) == 2  # the launcher, one worker
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


def test_checkpoint_alone_rebuilds_its_model_from_recorded_dims(tmp_path, smoke_dataset, env_with_venv):
    """The trainer records the model's dimensions; the one loader rebuilds the model from the checkpoint alone
    (no dataset, no second build to infer the action size) and its predictions equal the trained model's."""
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.models import restore

    run_dir = tmp_path / "run"
    traced(run_dir, smoke_dataset, env_with_venv, None, "trainer.steps=2", "checkpoint.every=2")
    state = CheckpointManager(str(run_dir / "checkpoints")).load(2)
    identity = state["identity"]
    assert identity[restore.DIMS_KEY] == {"obs_dim": 3, "act_dim": 1}  # Pendulum: cos, sin, velocity; torque
    built = []
    original = restore.build_model
    restore.build_model = lambda *args: built.append(args) or original(*args)
    try:
        model = restore.restore_model(identity["config"]["model"], state["model"], identity)
    finally:
        restore.build_model = original
    assert len(built) == 1 and built[0][1:] == (3, 1)
    assert all((model.state_dict()[k] == v).all() for k, v in state["model"].items())

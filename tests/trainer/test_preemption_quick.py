"""Preemption in the default tier: a real SIGTERM/SIGUSR1 delivered to a running single-process training.

The trainer must finish the step it is in, publish a checkpoint of *that* step (not only of the cadence's
steps: `checkpoint.every` is set beyond the run here, so the only checkpoint a preempted run can have is the one
preemption forces), write the PREEMPTED record and exit with 75; the same command resumes from that step
(checked in the slow tier).
The signal is sent once the start-up trace (``WORLDPIPE_STARTUP_TRACE``) shows a finished step, i.e. the
trainer's own handler is installed and the loop is running. The 2-rank path is in the slow tier
(`test_train_recovery.py::test_preemption_signal_checkpoints_and_exits_75`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from worldpipe.checkpoint import CheckpointManager
from worldpipe.measure.startup import TRACE_ENV
from worldpipe.trainer.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD

pytestmark = [pytest.mark.crash, pytest.mark.integration]

STEPS = 100_000  # never reached: the signal stops the run long before
EVERY = 10 * STEPS  # no cadence checkpoint: only preemption can publish one
GUARD_S = 120  # only stops a run that never starts stepping from hanging the suite


def train_cmd(run_dir: Path, dataset, steps: int = STEPS) -> list[str]:
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke", "parallel=single", f"run_dir={run_dir}",
            f"data.store={store}", f"data.manifest={manifest}", "tracking.enabled=false",
            "trainer.progress_bar=false", f"trainer.steps={steps}", f"checkpoint.every={EVERY}"]


def wait_for_a_step(trace: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + GUARD_S
    while not (trace.exists() and '"step_end"' in trace.read_text()):
        assert proc.poll() is None, f"training ended before its first step: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "no training step within the guard time"
        time.sleep(0.02)


# SIGUSR1 (SLURM's warning signal) in the default tier; SIGTERM takes the same path, and the resume (a second
# process) is checked with it in the slow tier, as in test_train_recovery.py on 2 ranks.
@pytest.mark.parametrize("sig", [signal.SIGUSR1, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGUSR1", "SIGTERM"])
def test_signal_mid_run_checkpoints_the_stop_step_and_exits_75(sig, tmp_path, smoke_dataset, env_with_venv):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    proc = subprocess.Popen(train_cmd(run_dir, smoke_dataset), env={**env_with_venv, TRACE_ENV: str(trace)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_a_step(trace, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stop = json.loads((run_dir / PREEMPTED_RECORD).read_text())["final_step"]
    assert 0 < stop < STEPS and stop % EVERY != 0
    manager = CheckpointManager(run_dir / "checkpoints", verify="sha256")
    assert [info.step for info in manager.list()] == [stop], "preemption did not checkpoint the step it stopped at"
    assert manager.latest_intact() == stop
    assert not (run_dir / "train_done.json").exists()

    if sig == signal.SIGTERM:  # and the run resumes from there (once is enough: the path is the same)
        resumed = subprocess.run(train_cmd(run_dir, smoke_dataset, steps=stop + 2), env=env_with_venv,
                                 capture_output=True, text=True, timeout=GUARD_S)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"step {stop}" in (resumed.stdout + resumed.stderr).split("resumed from", 1)[1].splitlines()[0]
        assert json.loads((run_dir / "train_done.json").read_text())["final_step"] == stop + 2
        assert not (run_dir / PREEMPTED_RECORD).exists()

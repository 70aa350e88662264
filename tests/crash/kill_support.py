"""Kill a training run with SIGKILL at a random point, and prove the kill landed.

A random delay can miss: the run may finish before it, or die before any checkpoint exists. Then the test
would silently become a plain rerun. :func:`kill_at_random_point` checks that the launcher died of SIGKILL,
that a checkpoint was published and that the run was unfinished, and otherwise starts over with a shorter
delay; it fails the test if no attempt lands.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from processes import pids_with_arg, wait_gone
from worldpipe.checkpoint import CheckpointManager

ATTEMPTS = 4
STARTUP_GUARD_S = 180  # only stops a run that never publishes from hanging the suite


@dataclass(frozen=True)
class Kill:
    """Where a landed kill left the run: the newest intact step and the delay that landed."""

    step: int
    delay_s: float
    attempts: int


def kill_at_random_point(cmd: list[str], run_dir: Path, env: dict, seed: int, final_step: int,
                         max_delay_s: float = 1.5, clean: tuple[Path, ...] = (),
                         kill: Callable[[subprocess.Popen, Path], None] | None = None) -> Kill:
    """Start ``cmd`` (a training run writing ``run_dir``), SIGKILL it a random time after its first checkpoint,
    and return once a kill landed mid-run. ``clean`` lists more paths a failed attempt must remove before the
    next (e.g. a tracking store outside ``run_dir``). ``kill(proc, run_dir)`` does the killing (default:
    :func:`kill_every_process`); it is called only while the run is still going."""
    kill = kill or kill_every_process
    delay = random.Random(seed).uniform(0.0, max_delay_s)
    for attempt in range(1, ATTEMPTS + 1):
        for path in (run_dir, *clean):
            shutil.rmtree(path, ignore_errors=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            published = _wait_for_first_checkpoint(run_dir, proc)
            if published:
                time.sleep(delay)  # somewhere in the next steps or inside a save
            if proc.poll() is None:
                kill(proc, run_dir)
            code = proc.wait(timeout=60)
        finally:
            _kill_group(proc)
        step = CheckpointManager(run_dir / "checkpoints").latest_intact() if published else None
        unfinished = not (run_dir / "train_done.json").exists() and step is not None and step < final_step
        if code == -signal.SIGKILL and unfinished:
            return Kill(step, delay, attempt)
        delay /= 4
    pytest.fail(f"no kill landed mid-run in {ATTEMPTS} attempts (last exit status {code})")


def _wait_for_first_checkpoint(run_dir: Path, proc: subprocess.Popen) -> bool:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + STARTUP_GUARD_S
    while not latest.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_every_process(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's process group and every process of the run (torchrun starts each worker in a
    session of its own, so the group alone does not reach the ranks), then wait until all are gone."""
    processes = pids_with_arg(str(run_dir))
    _kill_group(proc)
    for pid in processes - {proc.pid}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    survivors = wait_gone(processes | pids_with_arg(str(run_dir)), timeout=30)
    assert not survivors, f"processes of {run_dir} survived SIGKILL: {survivors}"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # the group ended between poll and kill
            os.killpg(proc.pid, signal.SIGKILL)

"""Kill a training run with SIGKILL at a random point or at a named phase, and prove the kill landed.

A random delay can miss: the run may finish before it, or die before any checkpoint exists. Then the test
would silently become a plain rerun. :func:`kill_at_random_point` checks that the launcher died of SIGKILL,
that a checkpoint was published and that the run was unfinished, and otherwise starts over with a shorter
delay; it fails the test if no attempt lands.

A fault (``WORLDPIPE_CKPT_FAULT=<phase>@<step>:die``) can miss too: a rank that *exits* at the phase (an error,
a changed fault action) also leaves a non-zero status and a half-written step. :func:`assert_died_of_sigkill`
proves the process that hit the fault was killed by SIGKILL: the training process itself (one process: the
launcher trains in-process) or, under torchrun, the failed rank torchrun reports.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
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

# torchrun's report of the first rank that failed (it goes to RUN_DIR/errors.log with the rest of torchrun's
# own output once `worldpipe train` fails, or to stderr when torchrun is run directly).
TORCHRUN_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
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


def assert_died_of_sigkill(proc: subprocess.CompletedProcess, run_dir: Path | None = None,
                           rank: int | None = None) -> None:
    """The run ``proc`` ran died of SIGKILL: its own status is -9 (a single process), or torchrun reports a rank
    (``rank``, if given) that failed with exit code -9, in ``run_dir/errors.log`` or on stderr."""
    if proc.returncode == -signal.SIGKILL:
        return
    log = run_dir / "errors.log" if run_dir is not None else None
    text = (log.read_text(errors="replace") if log is not None and log.exists() else "") + (proc.stderr or "")
    failure = TORCHRUN_FAILURE.search(text)
    assert proc.returncode != 0 and failure is not None, \
        f"exit status {proc.returncode} and no torchrun report of a failed rank:\n{text[-2000:]}"
    assert int(failure.group(1)) == -signal.SIGKILL, f"the rank did not die of SIGKILL: {failure.group(0)}"
    assert rank is None or int(failure.group(2)) == rank, f"another rank failed first: {failure.group(0)}"

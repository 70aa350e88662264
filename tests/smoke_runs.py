"""The crash tests' training command, and the smoke runs several slow modules start from, each run once.

``train_cmd``/``run_train``: `worldpipe train experiment=smoke` for 30 steps with a checkpoint every 10 (real
torchrun, 2 gloo ranks unless told otherwise), tracking off. :class:`SmokeRuns` (the session fixture
``smoke_runs``) runs each distinct such training once per session and hands the same run to every test that
asks: an uninterrupted run per layout (the reference a resumed run must end equal to), and runs SIGKILLed by a
fault at a named phase (what the recovery, refusal and world-size tests resume from). A test never changes a
shared run: it reads it, or copies it (:meth:`SmokeRuns.copy`) and goes on from the copy. The modules that ask
for the fixture run in one xdist group (tests/conftest.py), so each shared run is trained once per `make test`.

The uninterrupted runs train on ranks forked from the test (tests/forked_ranks.py: the same config, checks and
worker body as `worldpipe train`, without a torchrun start-up; a forked run's digest is a torchrun run's, which
every test resuming a killed `worldpipe train` to a reference's digest checks again). The killed runs are real
`worldpipe train` processes: a kill must hit the processes `worldpipe train` starts.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from forked_ranks import train_on_ranks

STEPS, EVERY = 30, 10


def train_cmd(run_dir: Path, dataset, *extra: str) -> list[str]:
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false",
            f"trainer.steps={STEPS}", f"checkpoint.every={EVERY}", *extra]


def run_train(run_dir, dataset, env, *extra, fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(env)
    if fault:
        env["WORLDPIPE_CKPT_FAULT"] = fault
    return subprocess.run(train_cmd(run_dir, dataset, *extra), env=env, capture_output=True, text=True,
                          timeout=300)


@dataclass(frozen=True)
class Run:
    """A shared run: its directory (read it, or copy it) and how its `worldpipe train` process ended (None for a
    run on forked ranks)."""

    dir: Path
    proc: subprocess.CompletedProcess | None


class SmokeRuns:
    """Smoke trainings shared by the tests of a session (see the module docstring)."""

    def __init__(self, root: Path, dataset, env: dict) -> None:
        self.root, self.dataset, self.env = root, dataset, env
        self._runs: dict[tuple, Run] = {}

    def straight(self, *extra: str) -> Run:
        """The uninterrupted run with these overrides, trained on forked ranks."""
        key = (None, extra)
        if key not in self._runs:
            run_dir = self.root / f"run{len(self._runs)}"
            train_on_ranks(train_cmd(run_dir, self.dataset, *extra)[2:], tmp=self.root / "ranks")
            self._runs[key] = Run(run_dir, None)
        return self._runs[key]

    def killed(self, fault: str, *extra: str) -> Run:
        """`worldpipe train` with these overrides under ``WORLDPIPE_CKPT_FAULT=fault`` (the caller checks how it
        died)."""
        key = (fault, extra)
        if key not in self._runs:
            run_dir = self.root / f"run{len(self._runs)}"
            self._runs[key] = Run(run_dir, run_train(run_dir, self.dataset, self.env, *extra, fault=fault))
        return self._runs[key]

    @staticmethod
    def copy(run: Run, dest: Path) -> Path:
        """A copy of a shared run's directory at ``dest``, to resume or damage; returns ``dest``."""
        shutil.copytree(run.dir, dest, symlinks=True)
        return dest

"""No durable write on the training step's path that is not a checkpoint: traced with strace, a run three times as
long (same start, same final checkpoint, three times the log lines of the progress record) makes exactly as many
fsync calls. A durable write per step or per log interval would add calls with the steps."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mlflow_support import BIN

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two traced trainings: ~20 s

_SYNC = re.compile(r"\b(fsync|fdatasync)\((\d+)<([^>]*)>")


def _fsyncs(run_dir: Path, dataset, env: dict, steps: int) -> list[str]:
    if shutil.which("strace") is None:
        pytest.fail("strace is missing (make system-deps installs it)")
    trace = run_dir.parent / f"{run_dir.name}.strace"
    cmd = ["strace", "-f", "-y", "-e", "trace=fsync,fdatasync", "-o", str(trace), str(BIN / "worldpipe"), "train",
           "experiment=smoke", f"run_dir={run_dir}", f"data.store={dataset[0]}", f"data.manifest={dataset[1]}",
           "parallel.nproc_per_node=1", "tracking=none", "trainer.progress_bar=false", f"trainer.steps={steps}",
           "trainer.log_every=5", f"checkpoint.every={steps}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [match.group(3) for match in _SYNC.finditer(trace.read_text())]


def test_a_longer_run_makes_no_more_fsyncs(tmp_path, smoke_dataset, env_with_venv):
    short = _fsyncs(tmp_path / "short", smoke_dataset, env_with_venv, 10)
    long = _fsyncs(tmp_path / "long", smoke_dataset, env_with_venv, 30)
    assert short, "strace saw no fsync at all: the final checkpoint must make some"
    assert len(long) == len(short), sorted(set(long) - set(short)) or long
    assert not any(path.endswith("progress.jsonl") for path in long)

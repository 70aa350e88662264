"""trainer.compile: a compiled run killed after a checkpoint resumes to the bits of an uninterrupted compiled run."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]


def compiled_run(run_dir: Path, dataset, env: dict, fault: str | None = None) -> subprocess.CompletedProcess:
    store, manifest = dataset
    cache = run_dir.parent / "compile-cache"  # shared by the runs of a test, as results/cache is by a project's runs
    cmd = ["worldpipe", "train", "experiment=smoke", "parallel=single", "trainer.compile=true", f"run_dir={run_dir}",
           f"paths.compile_cache={cache}",
           f"data.store={store}", f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false",
           "trainer.steps=6", "checkpoint.every=3",
           # A short window keeps the run short; the filter's recurrence runs eagerly either way (a graph break).
           "data.window=2"]
    env = {k: v for k, v in env.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env = {**env, "WORLDPIPE_CKPT_FAULT": fault} if fault else env
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)


def test_compiled_run_resumes_bit_identically_with_itself(tmp_path, smoke_dataset, env_with_venv):
    whole = compiled_run(tmp_path / "whole", smoke_dataset, env_with_venv)
    assert whole.returncode == 0, whole.stderr[-3000:]
    # The compiled artifacts land in the project's cache (not the node's /tmp), where a resume finds them.
    cached = [p for p in (tmp_path / "compile-cache").rglob("*") if p.is_file()]
    assert any("fxgraph" in p.parts for p in cached), sorted(str(p) for p in cached)[:20]
    killed = compiled_run(tmp_path / "killed", smoke_dataset, env_with_venv, fault="after_latest@3:die")
    # One process, trained in the launcher: the launcher itself dies of the SIGKILL, after step 3 is `latest`.
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "step-000003"
    resumed = compiled_run(tmp_path / "killed", smoke_dataset, env_with_venv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    digests = [json.loads((tmp_path / n / "train_done.json").read_text())["digest"] for n in ("whole", "killed")]
    assert digests[0] == digests[1]

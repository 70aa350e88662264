"""A hand run is config-addressed as a pipeline run: `worldpipe train experiment=smoke` trains into
results/runs/smoke/<run-hash>/ (the hash of the resolved config and the dataset spec), resumes there when nothing
changed, trains a changed value into a new folder, and points results/runs/smoke/latest at the newest; `run_dir=`
stays the escape hatch. Real `worldpipe train` processes, one rank each, tracking off."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _train(cwd: Path, dataset, env, *extra: str) -> subprocess.CompletedProcess:
    store, manifest = dataset
    cmd = ["worldpipe", "train", "experiment=smoke", f"data.store={store}", f"data.manifest={manifest}",
           "parallel=single", "tracking.enabled=false", "trainer.progress_bar=false", "checkpoint.every=10", *extra]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _run_dirs(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "results/runs/smoke").iterdir() if not p.is_symlink())


def _latest(cwd: Path) -> str:
    return os.readlink(cwd / "results/runs/smoke/latest")


def test_a_hand_run_resumes_its_config_and_trains_a_changed_value_into_a_new_run(tmp_path, smoke_dataset,
                                                                                  env_with_venv):
    first = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    (address,) = _run_dirs(tmp_path)
    run = tmp_path / "results/runs/smoke" / address
    record = json.loads((run / "run.json").read_text())
    assert record["run_hash"].startswith(address) and _latest(tmp_path) == address
    assert json.loads((run / "train_done.json").read_text())["final_step"] == 10
    assert f"run directory: results/runs/smoke/{address}" in first.stdout

    again = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=10")
    assert again.returncode == 0 and "finished already; nothing to train" in again.stderr, again.stderr[-3000:]
    assert len(json.loads((run / "run.json").read_text())["attempts"]) == 1  # no attempt, nothing invalidated

    changed = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=10", "trainer.lr=2e-3")
    assert changed.returncode == 0, changed.stderr[-3000:]
    dirs = _run_dirs(tmp_path)
    assert len(dirs) == 2 and _latest(tmp_path) != address and _latest(tmp_path) in dirs

    longer = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=20")  # resume-safe: the same run
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert _run_dirs(tmp_path) == dirs and _latest(tmp_path) == address
    assert json.loads((run / "train_done.json").read_text())["final_step"] == 20
    assert [a["exit_code"] for a in json.loads((run / "run.json").read_text())["attempts"]] == [0, 0]

    shorter = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=5")  # the same address, 20 steps done
    assert shorter.returncode == 0, shorter.stderr[-3000:]
    assert "is at step 20, past trainer.steps=5; nothing to train" in shorter.stderr, shorter.stderr[-3000:]
    assert len(json.loads((run / "run.json").read_text())["attempts"]) == 2  # not reopened

    escape = _train(tmp_path, smoke_dataset, env_with_venv, "trainer.steps=10", "run_dir=results/by-hand")
    assert escape.returncode == 0, escape.stderr[-3000:]
    assert (tmp_path / "results/by-hand/train_done.json").is_file() and _run_dirs(tmp_path) == dirs

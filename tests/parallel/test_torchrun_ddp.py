"""Real torchrun, 2 gloo ranks: training runs, replicas stay identical, checkpoints are published."""

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def train_smoke(run_dir: Path, dataset, env, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    store, manifest = dataset
    cmd = ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_ranks_end_with_identical_parameters(tmp_path, smoke_dataset, env_with_venv):
    run_dir = tmp_path / "run"
    proc = train_smoke(run_dir, smoke_dataset, env_with_venv, "trainer.steps=12", "checkpoint.every=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run_dir / "train_done.json").read_text())
    assert record["world_size"] == 2 and record["final_step"] == 12
    digests = record["replica_digests"]
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0] is not None
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-000006", "step-000012"]
    assert (run_dir / "checkpoints" / "latest").exists()

"""The code version recorded with a run: git SHA, dirty flag, and the uncommitted diff as an artifact.

Trains from a throwaway git copy of this checkout (``PYTHONPATH`` points at its ``src/``, so the launcher and
every torchrun rank import it and record *its* git state), first with an uncommitted change, then clean.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from worldpipe.tracking.history import read_artifact

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DIFF_ARTIFACT = "code/git_diff.patch"


def git(root: Path, *args: str) -> str:
    cmd = ["git", "-C", str(root), "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.fixture()
def checkout(tmp_path) -> Path:
    """A committed git copy of this checkout's files (tracked and untracked-not-ignored)."""
    root = tmp_path / "checkout"
    listed = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes((REPO / rel).read_bytes())
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "snapshot")
    return root


def train(checkout: Path, run_dir: Path, dataset, db: Path, env: dict) -> dict:
    store, manifest = dataset
    env = dict(env, PYTHONPATH=str(checkout / "src"))
    cmd = ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", f"tracking.uri=sqlite:///{db}", "trainer.progress_bar=false",
           "trainer.steps=2", "trainer.log_every=1", "checkpoint.every=2"]
    proc = subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "train_done.json").read_text())


def test_dirty_checkout_is_flagged_with_its_diff_and_a_clean_one_is_not(checkout, tmp_path, smoke_dataset,
                                                                        env_with_venv):
    db = tmp_path / "mlflow" / "mlflow.db"
    config = checkout / "conf" / "config.yaml"
    config.write_text(config.read_text() + "# an uncommitted change\n")
    diff = git(checkout, "diff", "HEAD")
    assert "+# an uncommitted change" in diff

    dirty = train(checkout, tmp_path / "dirty", smoke_dataset, db, env_with_venv)
    client = MlflowClient(f"sqlite:///{db}")
    tags = client.get_run(dirty["mlflow_run_id"]).data.tags
    assert tags["worldpipe.git_sha"] == git(checkout, "rev-parse", "HEAD").strip()
    assert tags["worldpipe.git_dirty"] == "True"
    assert tags["worldpipe.git_diff_sha256"] == hashlib.sha256(diff.encode()).hexdigest()
    assert read_artifact(client, dirty["mlflow_run_id"], DIFF_ARTIFACT).decode() == diff

    git(checkout, "commit", "-q", "-am", "commit the change")
    clean = train(checkout, tmp_path / "clean", smoke_dataset, db, env_with_venv)
    run = client.get_run(clean["mlflow_run_id"])
    assert run.data.tags["worldpipe.git_sha"] == git(checkout, "rev-parse", "HEAD").strip()
    assert run.data.tags["worldpipe.git_dirty"] == "False"
    assert "worldpipe.git_diff_sha256" not in run.data.tags
    assert [a.path for a in client.list_artifacts(run.info.run_id, "code")] == []

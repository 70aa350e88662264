"""`worldpipe rerun` / `resume` / `compare` on a real smoke run recorded in an embedded SQLite MLflow.

The original run trains on a copy of the smoke dataset that is deleted before the rerun: the rerun must rebuild
the config, world size and dataset from the MLflow records alone (regenerating the data from the recorded spec).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlflow_support import train_command
from worldpipe.config.identity import flatten
from worldpipe.tracking.history import duplicate_steps, first_difference, histories, read_artifact
from worldpipe.tracking.records import split_params

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(cmd: list[str], env: dict, cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, smoke_dataset, env_with_venv):
    root = tmp_path_factory.mktemp("rerun")
    data = root / "data"
    shutil.copytree(Path(smoke_dataset[0]).parent, data)
    uri = f"sqlite:///{root / 'results' / 'mlflow.db'}"
    run_dir = root / "runs" / "original"
    proc = _run(train_command(run_dir, (data / "store.zarr", data / "manifest.json"), uri, "trainer.steps=20",
                              "checkpoint.every=5"), env_with_venv, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(data)  # the rerun must regenerate it from the recorded spec
    run_id = json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"]
    return {"root": root, "uri": uri, "run_id": run_id, "run_dir": run_dir}


def test_sqlite_run_records_every_config_key_and_keeps_artifacts_beside_the_database(recorded):
    client = MlflowClient(recorded["uri"])
    run = client.get_run(recorded["run_id"])
    config = json.loads(read_artifact(client, run.info.run_id, "identity.json"))["config"]
    fitting, _ = split_params(flatten(config))
    assert len(run.data.params) == len(flatten(config)) and run.data.params == fitting
    assert (recorded["root"] / "results" / "mlartifacts").is_dir()
    assert not (recorded["root"] / "mlruns").exists()


def test_rerun_from_records_alone_is_bit_identical(recorded, env_with_venv):
    root = recorded["root"]
    proc = _run(["worldpipe", "rerun", recorded["run_id"], "--tracking-uri", recorded["uri"],
                 "--data-dir", str(root / "regenerated")], env_with_venv, root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "regenerated" in proc.stdout and "bit-identical" in proc.stdout
    # The default run directory: beside the experiment's config-addressed runs, named as a rerun of its source.
    (rerun_dir,) = (root / "results" / "runs" / "smoke").glob(f"rerun-{recorded['run_id'][:8]}-*")
    client = MlflowClient(recorded["uri"])
    new_id = json.loads((rerun_dir / "train_done.json").read_text())["mlflow_run_id"]
    new = client.get_run(new_id)
    assert new.data.tags["worldpipe.rerun_of"] == recorded["run_id"]
    assert new.data.tags["worldpipe.rerun_result"].startswith("bit-identical")
    assert new.data.tags["worldpipe.config_hash"] == client.get_run(recorded["run_id"]).data.tags["worldpipe.config_hash"]

    compare = _run(["worldpipe", "compare", recorded["run_id"], new_id, "--tracking-uri", recorded["uri"]],
                   env_with_venv, root)
    # A bit-identical rerun differs from its original only in params that name a run (run_dir), which the
    # table leaves out, and in nothing that identifies it (git sha, dataset, checkpoint digest).
    assert compare.returncode == 0, compare.stderr
    assert "param differences: none" in compare.stdout and "identity differences: none" in compare.stdout
    assert "loss/total" in compare.stdout

    listed = _run(["worldpipe", "runs", "list"], env_with_venv, root)
    assert listed.returncode == 0, listed.stderr
    assert f"rerun of original (mlflow {recorded['run_id']}): bit-identical" in listed.stdout, listed.stdout
    status = _run(["worldpipe", "runs", "status"], env_with_venv, root)
    assert f"{rerun_dir.name}" in status.stdout and "finished at step 20 (rerun of original)" in status.stdout, (
        status.stdout)


def test_resume_from_a_recorded_checkpoint_continues_into_a_new_run(recorded, env_with_venv):
    root = recorded["root"]
    proc = _run(["worldpipe", "resume", recorded["run_id"], "--step", "15", "--tracking-uri", recorded["uri"],
                 "--run-dir", str(root / "runs" / "resumed"), "--data-dir", str(root / "regenerated")],
                env_with_venv, root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    client = MlflowClient(recorded["uri"])
    new_id = json.loads((root / "runs" / "resumed" / "train_done.json").read_text())["mlflow_run_id"]
    tags = client.get_run(new_id).data.tags
    assert tags["worldpipe.resumed_from"] == recorded["run_id"] and tags["worldpipe.resumed_at_step"] == "15"
    original, resumed = histories(client, recorded["run_id"]), histories(client, new_id)
    assert not duplicate_steps(resumed)
    assert first_difference(original, resumed) is None  # copied history up to 15, then the same steps
    assert tags["worldpipe.checkpoint.digest"] == client.get_run(recorded["run_id"]).data.tags["worldpipe.checkpoint.digest"]

    missing = _run(["worldpipe", "resume", recorded["run_id"], "--step", "5", "--tracking-uri", recorded["uri"],
                    "--run-dir", str(root / "runs" / "nope")], env_with_venv, root)
    assert missing.returncode == 2 and "no longer" in missing.stderr


def test_rerun_exits_1_and_names_the_first_difference_when_the_record_disagrees(recorded, env_with_venv):
    """Last in this module: it alters the recorded history (a later value at step 10 of loss/total, as if the
    original had computed something else), so the faithful rerun must report a difference and exit 1."""
    root = recorded["root"]
    client = MlflowClient(recorded["uri"])
    original = {m.step: m for m in client.get_metric_history(recorded["run_id"], "loss/total")}[10]
    client.log_metric(recorded["run_id"], "loss/total", original.value + 1.0, timestamp=original.timestamp + 1,
                      step=10)
    proc = _run(["worldpipe", "rerun", recorded["run_id"], "--tracking-uri", recorded["uri"],
                 "--run-dir", str(root / "runs" / "rerun-differs"), "--data-dir", str(root / "regenerated")],
                env_with_venv, root)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "differs: first at step 10, metric loss/total" in proc.stdout
    assert "Traceback" not in proc.stderr

"""A real `mlflow server --workers 1` on 127.0.0.1: a smoke run logged over HTTP, read back with MlflowClient.

The server is SIGKILLed right after the first checkpoint and restarted only after training ended: training must
finish anyway, warn, spool, and `worldpipe tracking sync` must then complete the history without duplicates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from mlflow_support import MlflowServer, train_command
from worldpipe.config.identity import flatten
from worldpipe.tracking.history import duplicate_steps, histories, read_artifact
from worldpipe.tracking.records import TIMING_METRICS, split_params
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS, LOG_EVERY, EVERY = 40, 5, 10  # experiment=smoke


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).start()
    yield srv
    srv.kill()


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"training ended before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def interrupted(server, smoke_dataset, env_with_venv, tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupted")
    run_dir = root / "run"
    log = root / "train.log"
    with open(log, "w") as out:
        env = dict(env_with_venv, WORLDPIPE_RULE="train_model", WORLDPIPE_JOB="smoke")  # as the Snakemake rule sets
        proc = subprocess.Popen(train_command(run_dir, smoke_dataset, server.url), env=env, cwd=root,
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(run_dir / "checkpoints" / "step-000010", proc)
            server.kill()  # mid-run crash of the tracking server
            code = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 0, text[-4000:]
    pending = len(Spool(run_dir).pending())
    server.start()
    sync = subprocess.run(["worldpipe", "tracking", "sync", str(run_dir)], env=env_with_venv, cwd=root,
                          capture_output=True, text=True, timeout=120)
    again = subprocess.run(["worldpipe", "tracking", "sync", str(run_dir)], env=env_with_venv, cwd=root,
                           capture_output=True, text=True, timeout=120)
    return {"run_dir": run_dir, "log": text, "pending_before_sync": pending, "sync": sync, "again": again,
            "client": MlflowClient(server.url)}


def test_training_survives_the_server_crash_and_says_so(interrupted):
    assert "unreachable" in interrupted["log"] and "worldpipe tracking sync" in interrupted["log"]
    assert interrupted["pending_before_sync"] > 0
    assert interrupted["sync"].returncode == 0, interrupted["sync"].stdout + interrupted["sync"].stderr
    assert interrupted["again"].returncode == 0 and "delivered 0" in interrupted["again"].stdout
    # MLflow's own "View run ... at: URL" (the GenAI layout) is not printed when sync ends the run on the server
    assert "View run" not in interrupted["sync"].stdout + interrupted["log"]


def test_history_is_complete_and_without_duplicates_after_sync(interrupted):
    client = MlflowClient(interrupted["client"].tracking_uri)
    done = json.loads((interrupted["run_dir"] / "train_done.json").read_text())
    run_id = done["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = {k: v for k, v in histories(client, run_id).items() if not k.startswith(SYSTEM_PREFIX)}
    expected = {"loss/total", "loss/recon", "loss/reward", "loss/kl", "grad_norm", "lr", *TIMING_METRICS}
    assert set(history) == expected
    steps = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for key, points in history.items():
        assert [s for s, _, _ in points] == steps, key
    assert not duplicate_steps(history)
    assert run.data.tags["worldpipe.checkpoint.step"] == str(STEPS)
    assert run.data.tags["worldpipe.checkpoint.digest"] == done["digest"]


def test_params_equal_the_flattened_config_and_artifacts_are_present(interrupted):
    client = MlflowClient(interrupted["client"].tracking_uri)
    run_id = json.loads((interrupted["run_dir"] / "train_done.json").read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    config = yaml.safe_load(read_artifact(client, run_id, "config.yaml"))
    flat = flatten(config)
    fitting, _ = split_params(flat)
    assert len(run.data.params) == len(flat)
    assert run.data.params == fitting
    identity = json.loads(read_artifact(client, run_id, "identity.json"))
    assert identity["config"] == config and identity["world_size"] == 2
    for tag in ("worldpipe.git_sha", "worldpipe.dataset_hash", "worldpipe.lock_hash", "worldpipe.torch_version",
                "worldpipe.numpy_version", "worldpipe.python_version", "worldpipe.world_size", "worldpipe.seed",
                "worldpipe.host", "worldpipe.parallel_layout"):
        assert run.data.tags.get(tag) not in (None, "None"), tag
    assert run.data.tags["worldpipe.dataset_hash"] == identity["dataset_hash"]
    # the training dataset is a run input (spooled like every record, replayed by the sync)
    assert [(d.dataset.name, d.dataset.digest) for d in run.inputs.dataset_inputs] == [
        ("smoke", identity["dataset_hash"][:32])]
    assert run.data.tags["worldpipe.snakemake.rule"] == "train_model" and run.data.tags["worldpipe.snakemake.job"] == "smoke"
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "identity.json", "dataset", "environment", "hydra", "segments", "checkpoints"} <= top
    assert "experiment=smoke" in yaml.safe_load(read_artifact(client, run_id, "hydra/overrides.yaml"))
    manifest = json.loads(read_artifact(client, run_id, "dataset/manifest.json"))
    assert manifest["dataset_hash"] == identity["dataset_hash"] and "spec" in manifest
    assert "torch==" in read_artifact(client, run_id, "environment/packages.txt").decode()
    steps = sorted(a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, "checkpoints"))
    assert steps == [f"step-{s:06d}" for s in range(EVERY, STEPS + 1, EVERY)]
    base = f"checkpoints/step-{STEPS:06d}"
    names = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, base)}
    assert {"MANIFEST.json", "digest.json", "train_state.json", "rng"} <= names
    rng = json.loads(read_artifact(client, run_id, f"{base}/rng/rank-00001.json"))
    assert "torch" in rng and "python" in rng
    sampler = json.loads(read_artifact(client, run_id, f"{base}/train_state.json"))["sampler"]
    assert sampler["seed"] == config["seed"]


def test_ui_lists_the_runs_in_a_headless_chromium_screenshot(interrupted, server, tmp_path, env_with_venv):
    script = REPO / "workflow" / "scripts" / "screenshot_mlflow_ui.py"
    out = tmp_path / "mlflow_ui.png"
    proc = subprocess.run([sys.executable, str(script), "--tracking-uri", server.url, "--out", str(out), "--install",
                           "--expect", ">Model registry<", "--refuse", ">Judges<"],  # the Model training view
                          env=env_with_venv, capture_output=True, text=True, timeout=1500)
    if proc.returncode == 3:
        pytest.skip("Debian's chromium is not installed and cannot be installed here")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["shown"] == ["smoke"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and summary["bytes"] > 10_000

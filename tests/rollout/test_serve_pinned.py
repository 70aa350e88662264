"""`worldpipe serve` resolves its checkpoint once: moving `latest` to another run never changes what it serves.

A real server over HTTP on 127.0.0.1 (serve_support.ServerProcess), stopped by PID.
"""

from __future__ import annotations

import os
import time

import pytest

from serve_support import ServerProcess
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = pytest.mark.integration


def _health(server: ServerProcess) -> dict:
    response = server.get("/health")
    assert response.status_code == 200, response.text
    return response.json()


def test_serve_pins_the_run_latest_named_at_start_and_reloads_only_when_told(tmp_path, env_with_venv):
    experiment = tmp_path / "runs" / "demo"
    for run, seed in (("run-a", 0), ("run-b", 1)):
        publish_demo_checkpoint(experiment / run / "checkpoints", step=1, seed=seed)
    os.symlink("run-a", experiment / "latest")
    server = ServerProcess(experiment / "latest" / "checkpoints", tmp_path / "srv", env_with_venv)
    try:
        first = _health(server)
        log = server.log.read_text()
        assert f"serving {(experiment / 'run-a' / 'checkpoints').resolve()} step 1, model version " \
               f"{first['model_version']}" in log, log[-2000:]
        # the pipeline moves `latest` to another run, and run-a goes on training
        os.replace(_link(experiment, "run-b"), experiment / "latest")
        publish_demo_checkpoint(experiment / "run-a" / "checkpoints", step=2, seed=2)
        time.sleep(3)  # longer than the old 2 s polling: nothing may change by itself
        assert _health(server)["model_version"] == first["model_version"]
        reloaded = server.post("/reload", {}).json()
        assert reloaded["changed"] and reloaded["checkpoint_step"] == 2  # run-a's newest step, not run-b's
        assert reloaded["model_version"] != first["model_version"]
        assert server.post("/reload", {}).json()["changed"] is False
    finally:
        assert server.stop() == 0


def _link(experiment, target: str):
    tmp = experiment / ".latest.tmp"
    os.symlink(target, tmp)
    return tmp

"""`worldpipe rollout`: one request from a checkpoint; a named stream gives the same bits in every process."""

from __future__ import annotations

import json
import subprocess

import pytest

from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = pytest.mark.integration

REQUEST = {"context": {"obs": [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]], "action": [[0.5], [-0.5]]},
           "actions": [[1.0], [0.0], [-1.0], [0.5]], "rng": {"seed": 3, "stream": "cli"}}


def rollout(checkpoint, request_file, env) -> subprocess.CompletedProcess:
    return subprocess.run(["worldpipe", "rollout", str(checkpoint), "--request", str(request_file)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_rollout_command_is_reproducible_and_rejects_bad_input(tmp_path, env_with_venv):
    publish_demo_checkpoint(tmp_path / "checkpoints", step=5)
    good = tmp_path / "request.json"
    good.write_text(json.dumps(REQUEST))
    first, second = rollout(tmp_path / "checkpoints", good, env_with_venv), \
        rollout(tmp_path / "checkpoints" / "step-000005", good, env_with_venv)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:]
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["checkpoint_step"] == 5 and len(a["observations"]) == 4
    assert a["observations"] == b["observations"] and a["model_version"] == b["model_version"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**REQUEST, "actions": [[1.0, 2.0]]}))
    failed = rollout(tmp_path / "checkpoints", bad, env_with_venv)
    assert failed.returncode == 2
    assert "actions" in failed.stderr and "Traceback" not in failed.stderr

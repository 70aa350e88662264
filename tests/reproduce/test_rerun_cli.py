"""`worldpipe rerun` exit statuses from the command line that need no recorded training run.

0 (bit-identical) and 1 (different) need a recorded run and a retraining: `tests/reproduce/test_rerun.py`.
"""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.integration


def test_unknown_run_exits_2_with_one_line_naming_it(tmp_path, env_with_venv):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = "0123456789abcdef0123456789abcdef"
    proc = subprocess.run(["worldpipe", "rerun", run_id, "--tracking-uri", uri, "--run-dir", str(tmp_path / "r")],
                          env=env_with_venv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and run_id in errors[0] and uri in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing half-made

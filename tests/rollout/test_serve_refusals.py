"""Issue 19, case 5: `worldpipe serve` refuses what cannot work in one line and a usage exit status, before the
model loads and before uvicorn starts (no lifespan traceback): a missing, empty or all-damaged checkpoint
directory, a port outside 0..65535, a host that is no address. Real `worldpipe serve` processes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from checkpoint_states import rehash_step, slice_model_file
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served") / "checkpoints"
    publish_demo_checkpoint(root, step=1, seed=0)
    return root


def _serve(env: dict, *args: str) -> tuple[int, list[str]]:
    proc = subprocess.run(["worldpipe", "serve", *args], env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


def _damaged(tmp_path: Path) -> Path:
    root = tmp_path / "damaged" / "checkpoints"
    for step in (1, 2):
        publish_demo_checkpoint(root, step=step, seed=step)
        slice_model_file(root / f"step-{step:06d}")
        rehash_step(root / f"step-{step:06d}")  # every checksum matches; the shapes do not
    return root


@pytest.mark.parametrize("case", ["missing", "empty", "all damaged"])
def test_nothing_to_serve_is_one_line_and_exit_2(case, tmp_path, env_with_venv):
    root = {"missing": lambda: tmp_path / "nowhere",
            "empty": lambda: (tmp_path / "empty").mkdir() or tmp_path / "empty",
            "all damaged": lambda: _damaged(tmp_path)}[case]()
    rc, lines = _serve(env_with_venv, str(root), "--port", "0")
    assert rc == 2, lines
    assert not any("Traceback" in line or "uvicorn" in line.lower() for line in lines), lines
    assert lines[-1].startswith("error: ") and str(root) in lines[-1], lines
    # Besides the error: one line per step skipped, naming it and why.
    skipped = lines[:-1]
    if case == "all damaged":
        assert "no loadable checkpoint" in lines[-1]
        assert [re.search(r"skipping checkpoint \S+/(step-\d+): ", line)[1] for line in skipped] == [
            "step-000002", "step-000001"]
        assert all("model.pt" in line and "where the manifest records" in line for line in skipped)
    else:
        assert skipped == [], lines


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--port", "99999", "error: --port 99999: must be 0..65535"),
    ("--host", "999.1.1.1", "error: --host 999.1.1.1: not an IPv4 address"),
])
def test_bad_address_is_refused_before_the_model_loads(option, value, message, intact, env_with_venv):
    args = [str(intact), "--port", "0", option, value]
    rc, lines = _serve(env_with_venv, *args)
    assert rc == 2 and lines == [message], lines  # one line: no "serving step ..." (the model never loaded)


def test_a_port_in_use_is_refused_before_the_model_loads(intact, env_with_venv):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, lines = _serve(env_with_venv, str(intact), "--port", str(port))
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: --host 127.0.0.1 --port {port}: cannot "
                                                               "listen there"), lines

"""SIGKILL during publication, at every phase and at random moments: the store stays consistent.

A child process (forked from the test; a fresh interpreter for the object store) saves step 1, then dies
(WORLDPIPE_CKPT_FAULT=<phase>:die, i.e. SIGKILL to itself, or a kill -9 from this test) while saving step 2. Afterwards the store must hold the old or the new checkpoint
intact (never a partial one), `latest` must name an intact checkpoint, and the next save must clean up.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import uuid

import pytest
import torch

from checkpoint_states import example_state, save_until_killed
from forked_ranks import fork_after_collecting
from worldpipe.checkpoint import CheckpointManager
from worldpipe.checkpoint.fault import PHASES

pytestmark = pytest.mark.crash

CHILD = textwrap.dedent("""
    import json, sys
    from checkpoint_states import save_until_killed
    save_until_killed(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.stdout)
""")


class ForkedChild:
    """CHILD's loop in a process forked from the test (the checkpoint code is imported already: no interpreter
    start-up), with the Popen surface the tests use: ``stdout``, ``kill``, ``communicate``, ``returncode``."""

    def __init__(self, root, fault: str, mode: str) -> None:
        read_fd, write_fd = os.pipe()
        self.pid = fork_after_collecting()  # a child that collected inherited cycles could die with SIGSEGV
        if self.pid == 0:  # the child: never returns into pytest
            os.close(read_fd)
            code = 0
            try:
                # One intra-op thread, first: an OpenMP pool the test process used does not exist in a fork, and
                # a parallel region would wait for it forever.
                torch.set_num_threads(1)
                out = os.fdopen(write_fd, "w", buffering=1)
                save_until_killed(root, fault, mode, None, out)
            except BaseException:  # noqa: BLE001 - reported to the test as the child's error output
                with contextlib.suppress(Exception):
                    print(traceback.format_exc(), file=out, flush=True)
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        self.stdout = os.fdopen(read_fd)
        self.returncode: int | None = None

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float) -> tuple[str, str]:
        """(the rest of its output, the same text: the child's output and errors share one pipe)."""
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the child saver did not end within {timeout} s")
            else:
                time.sleep(0.02)
        out = self.stdout.read()
        self.stdout.close()
        return out, out


def _child(root, fault="", mode="sync", options=None):
    """The saver dying (or killed) during a publication: forked from the test for a local store; a fresh
    interpreter for an object store (its client's event loop must not be inherited)."""
    if not options:
        return ForkedChild(root, fault, mode)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("WORLDPIPE_CKPT_FAULT", None)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), fault, mode, json.dumps(options or {})],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_consistent(root, options=None, expect=None):
    """Invariants after a crash; returns the newest intact step."""
    cm = CheckpointManager(root, verify="sha256", storage_options=options)
    infos = cm.list()
    assert infos, "the checkpoint saved before the crash is gone"
    assert all(i.intact for i in infos), [i.problem for i in infos if not i.intact]
    newest = cm.latest_intact()
    assert newest == max(i.step for i in infos)
    if expect is not None:
        assert newest == expect
    latest = cm.store.read_latest()
    assert latest in {i.step for i in infos}, "latest names a step that is not an intact checkpoint"
    state = cm.load()
    assert state["sampler"]["seed"] == newest  # example_state(seed=step): the content belongs to the step
    return newest


def _posix_leftovers(root):
    return [n for n in os.listdir(root) if n.startswith(".step-") or n.startswith(".latest.tmp-")]


# before the rename the old checkpoint is newest; from the rename on, the new one is
EXPECTED = {phase: (1 if PHASES.index(phase) < PHASES.index("after_rename") else 2) for phase in PHASES}


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_phase(tmp_path, phase):
    root = tmp_path / "ck"
    proc = _child(root, f"{phase}:die")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert "saved 1" in out and "saved 2" not in out
    _check_consistent(root, expect=EXPECTED[phase])
    if phase in ("mid_files", "after_files", "after_manifest"):
        assert any(".partial-" in n for n in _posix_leftovers(root))  # the crash really left debris
    # the next save removes the debris and publishes normally
    cm = CheckpointManager(root, keep_last=2)
    cm.save(3, example_state(seed=3))
    assert _posix_leftovers(root) == []
    assert _check_consistent(root) == 3


def test_sigkill_in_async_background_writer(tmp_path):
    root = tmp_path / "ck"
    proc = _child(root, "after_files:die", mode="async")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    _check_consistent(root, expect=1)


@pytest.mark.parametrize("seed", range(4))
def test_kill9_at_random_moments(tmp_path, seed):
    root = tmp_path / "ck"
    proc = _child(root, "")
    assert proc.stdout.readline().strip() == "saved 1"
    time.sleep(random.Random(seed).uniform(0.0, 0.5))  # somewhere inside the following saves
    proc.kill()
    out, err = proc.communicate(timeout=60)
    # The child saves until killed: it must have died of this SIGKILL, not of an error of its own.
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    _check_consistent(root)
    CheckpointManager(root, keep_last=2).save(10_000, example_state(seed=10_000))
    assert _posix_leftovers(root) == []
    assert _check_consistent(root) == 10_000


@pytest.fixture(scope="module")
def s3_options(moto_endpoint):
    yield {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint}}


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
@pytest.mark.parametrize("phase, expect", [("mid_files", 1), ("after_files", 1), ("after_manifest", 2)])
def test_sigkill_object_store(s3_options, monkeypatch, phase, expect):
    import s3fs

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fs = s3fs.S3FileSystem(**s3_options)
    bucket = f"b{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    root = f"s3://{bucket}/ck"
    proc = _child(root, f"{phase}:die", options=s3_options)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    _check_consistent(root, s3_options, expect=expect)
    fs.invalidate_cache()
    if expect == 1:
        assert fs.exists(f"{bucket}/ck/step-000002")  # uncommitted files exist but are invisible
    CheckpointManager(root, storage_options=s3_options).save(3, example_state(seed=3))
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/ck")) == ["latest", "step-000002", "step-000003"] \
        if expect == 2 else ["latest", "step-000001", "step-000003"]

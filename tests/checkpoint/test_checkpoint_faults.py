"""Write failures: real ENOSPC (tmpfs), real EPERM (immutable dir), injected EIO at each phase.

After any failure: CheckpointWriteError names the step and the file, the partial dir is gone, the previous
checkpoint is intact and still `latest`.
"""

import os
import subprocess

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError


def _assert_previous_is_latest(root, step):
    cm = CheckpointManager(root, verify="sha256")
    assert [i.step for i in cm.list()] == [step]
    assert cm.latest_intact() == step and cm.verify(step) == []
    assert (root / "latest").read_text() == f"step-{step:06d}\n"
    assert not [n for n in os.listdir(root) if n.startswith(".step")]


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk(small_tmpfs):
    root = small_tmpfs / "ck"
    cm = CheckpointManager(root)
    cm.save(1, example_state(seed=1))
    big = example_state(seed=2)
    big["model"]["huge"] = torch.zeros(3 << 20, dtype=torch.uint8)  # 3 MiB > what is left
    with pytest.raises(CheckpointWriteError) as err:
        cm.save(2, big)
    assert err.value.step == 2 and "model.pt" in err.value.path
    assert isinstance(err.value.cause, OSError) and err.value.cause.errno == 28  # ENOSPC
    _assert_previous_is_latest(root, 1)
    cm.save(3, example_state(seed=3))  # space was given back
    assert CheckpointManager(root).latest_intact() == 3


def test_permission_denied(tmp_path):
    root = tmp_path / "ck"
    cm = CheckpointManager(root)
    cm.save(1, example_state(seed=1))
    if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i unsupported here")
    try:
        with pytest.raises(CheckpointWriteError) as err:
            cm.save(2, example_state(seed=2))
        assert err.value.step == 2 and ".step-000002.partial-" in err.value.path
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    _assert_previous_is_latest(root, 1)


@pytest.mark.parametrize("phase, names", [
    ("before_files", ".step-000002.partial-"),
    ("mid_files", ".step-000002.partial-"),
    ("after_files", ".step-000002.partial-"),
    ("after_manifest", ".step-000002.partial-"),
])
def test_injected_io_error_before_publication(tmp_path, monkeypatch, phase, names):
    root = tmp_path / "ck"
    cm = CheckpointManager(root)
    cm.save(1, example_state(seed=1))
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", f"{phase}:raise")
    with pytest.raises(CheckpointWriteError, match="step 2") as err:
        cm.save(2, example_state(seed=2))
    assert names in err.value.path
    monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
    _assert_previous_is_latest(root, 1)


def test_injected_error_after_rename_keeps_the_new_step(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    cm = CheckpointManager(root)
    cm.save(1, example_state(seed=1))
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_rename:raise")
    with pytest.raises(CheckpointWriteError, match="latest"):
        cm.save(2, example_state(seed=2))
    monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
    # step 2 is durable and intact, `latest` still names step 1; readers pick the newest intact
    assert (root / "latest").read_text() == "step-000001\n"
    assert CheckpointManager(root).latest_intact() == 2


def test_retention_failure_does_not_fail_the_save(tmp_path, monkeypatch, caplog):
    root = tmp_path / "ck"
    cm = CheckpointManager(root)
    cm.save(1, example_state(seed=1))
    cm.save(2, example_state(seed=2))
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "before_retention:raise")
    cm.save(3, example_state(seed=3))
    assert "retention" in caplog.text
    monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
    cm.save(4, example_state(seed=4))
    assert [i.step for i in cm.list()] == [3, 4]


def test_unknown_fault_phase_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_lunch:die")
    with pytest.raises(ValueError, match="after_lunch"):
        CheckpointManager(tmp_path / "ck").save(1, example_state())

"""Async saves: only the snapshot stalls, publication is ordered, background failures surface."""

import os
import threading

import pytest
import torch

from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError
from worldpipe.checkpoint.testing import example_state


def test_save_returns_before_publication(tmp_path, monkeypatch):
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "before_files:pause:1.0")
    state = example_state()
    cm.save(1, state)
    assert cm.list() == []  # still being written in the background
    expected = state["model"]["0.weight"].clone()
    state["model"]["0.weight"].add_(1.0)  # training continues and mutates the live state
    cm.wait()
    assert [i.step for i in cm.list()] == [1]
    assert torch.equal(cm.load(1)["model"]["0.weight"], expected)  # the snapshot was published
    cm.close()


def test_two_saves_publish_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "before_files:pause:0.3")
    with CheckpointManager(tmp_path / "ck", async_save=True, keep_last=3) as cm:
        cm.save(1, example_state(seed=1))
        cm.save(2, example_state(seed=2))  # waits for step 1 first
        assert [i.step for i in cm.list()] == [1]
    infos = CheckpointManager(tmp_path / "ck").list()
    assert [i.step for i in infos] == [1, 2] and infos[-1].is_latest
    m1 = os.stat(tmp_path / "ck" / "step-000001" / "MANIFEST.json").st_mtime_ns
    m2 = os.stat(tmp_path / "ck" / "step-000002" / "MANIFEST.json").st_mtime_ns
    assert m1 <= m2


@pytest.mark.parametrize("surface", ["save", "wait", "close"])
def test_background_failure_is_raised(tmp_path, monkeypatch, surface):
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    cm.save(1, example_state())
    cm.wait()
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files:raise")
    cm.save(2, example_state())  # fails in the background
    with pytest.raises(CheckpointWriteError, match="step 2"):
        getattr(cm, surface)(*([3, example_state()] if surface == "save" else []))
    monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
    # raised once, then the manager is usable again (save was not started when it raised)
    if surface != "close":
        cm.save(3, example_state())
        cm.close()
        assert [i.step for i in CheckpointManager(tmp_path / "ck").list()] == [1, 3]
    assert not [n for n in os.listdir(tmp_path / "ck") if ".partial-" in n]


def test_stall_is_the_snapshot_only(tmp_path, monkeypatch):
    # Publication blocks for 2 s; save() must come back long before (no wall-clock assertion on speed:
    # only that save() does not wait for publication).
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files:pause:2")
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    done = threading.Event()

    def save():
        cm.save(1, example_state())
        done.set()

    worker = threading.Thread(target=save)
    worker.start()
    assert done.wait(timeout=1.9)
    assert cm.list() == []
    cm.close()
    worker.join()
    assert [i.step for i in CheckpointManager(tmp_path / "ck").list()] == [1]


def test_closed_manager_refuses(tmp_path):
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    cm.close()
    cm.close()
    with pytest.raises(RuntimeError):
        cm.save(1, example_state())


def test_snapshot_buffers_are_recycled_safely(tmp_path):
    cm = CheckpointManager(tmp_path / "ck", async_save=True, keep_last=5)
    state = example_state()
    for step in range(1, 4):
        state["model"]["0.weight"].fill_(float(step))
        cm.save(step, state)
    cm.close()
    cm = CheckpointManager(tmp_path / "ck")
    for step in range(1, 4):
        assert torch.all(cm.load(step)["model"]["0.weight"] == step)

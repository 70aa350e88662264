"""Async saves: only the snapshot stalls, publication is ordered, background failures surface.

Tests hold publication at a named phase with :func:`worldpipe.checkpoint.fault.hooked` and observe while it is
held: no assertion depends on how long anything takes.
"""

import os
import threading

import pytest
import torch

from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError
from worldpipe.checkpoint.fault import hooked
from checkpoint_states import example_state

# Only a guard against a hang when the code under test is broken (a gate nobody releases); never a window.
HANG_GUARD_S = 60


class Gate:
    """A phase hook that holds publication of the chosen steps until released, recording every step seen."""

    def __init__(self, steps: set[int] | None = None):
        self.steps, self.seen = steps, []
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, step: int | None) -> None:
        self.seen.append(step)
        if self.steps is None or step in self.steps:
            self.reached.set()
            if not self.release.wait(HANG_GUARD_S):
                raise RuntimeError("gate never released: the caller waited for publication")


def test_save_returns_before_publication(tmp_path):
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    gate = Gate()
    with hooked("before_files", gate):
        state = example_state()
        cm.save(1, state)  # returns while publication is held at the gate
        assert gate.reached.wait(HANG_GUARD_S)
        assert cm.list() == []  # still being written in the background
        expected = state["model"]["0.weight"].clone()
        state["model"]["0.weight"].add_(1.0)  # training continues and mutates the live state
        gate.release.set()
        cm.wait()
    assert [i.step for i in cm.list()] == [1]
    assert torch.equal(cm.load(1)["model"]["0.weight"], expected)  # the snapshot was published
    cm.close()


def test_two_saves_publish_in_order(tmp_path):
    gate, published = Gate(steps={2}), Gate(steps=set())
    with (hooked("before_files", gate), hooked("after_latest", published),
          CheckpointManager(tmp_path / "ck", async_save=True, keep_last=3) as cm):
        cm.save(1, example_state(seed=1))
        cm.save(2, example_state(seed=2))  # waits for step 1 first; step 2 is then held at the gate
        assert gate.reached.wait(HANG_GUARD_S)
        assert [i.step for i in cm.list()] == [1]
        gate.release.set()
    assert published.seen == [1, 2]
    infos = CheckpointManager(tmp_path / "ck").list()
    assert [i.step for i in infos] == [1, 2] and infos[-1].is_latest


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


def test_stall_is_the_snapshot_only(tmp_path):
    # Publication is held after its files are written; save() must return while it is held (if save() waited
    # for publication, the gate would never be released and publication would fail, failing the test).
    cm = CheckpointManager(tmp_path / "ck", async_save=True)
    gate = Gate()
    with hooked("after_files", gate):
        cm.save(1, example_state())
        assert gate.reached.wait(HANG_GUARD_S)
        assert cm.list() == []
        gate.release.set()
        cm.close()
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

"""Async saves: only the snapshot stalls, publication is ordered, background failures surface.

Tests hold publication at a named phase with :func:`worldpipe.checkpoint.fault.hooked` and observe while it is
held: no assertion depends on how long anything takes.
"""

import os
import threading

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError
from worldpipe.checkpoint.fault import hooked

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


class _Loader:
    """The sampler's state holder (the Checkpointer saves it); the test is about when a save counts as durable."""

    def state_dict(self) -> dict:
        return {"cursor": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Listener:
    def __init__(self):
        self.published, self.durable_steps, self.digests = [], [], []

    def before_publish(self, step: int, final: bool) -> None:
        self.published.append(step)

    def durable(self, step: int, records, digest) -> None:
        self.durable_steps.append(step)
        self.digests.append(digest)


def test_poll_reports_an_async_save_durable_once_published_not_at_the_next_save(tmp_path):
    """The trainer polls every step: the listener (metrics released, records journaled) hears of a published
    async save then, while no later save runs; never before its publication is complete."""
    from worldpipe.checkpoint.checkpointer import Checkpointer, Progress, TrainingComponents
    from worldpipe.parallel.runtime import Runtime

    model = torch.nn.Linear(4, 2)
    components = TrainingComponents(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, _Loader(),
                                    Progress(step=10), {"run": "poll"})
    cfg = {"dir": str(tmp_path / "ck"), "every": 10, "keep_last": 2, "keep_every": None, "async_save": True,
           "verify": "first"}
    listener = _Listener()
    checkpointer = Checkpointer(cfg, Runtime(0, 1, 0, torch.device("cpu")), components, listener=listener)
    gate = Gate()
    with hooked("after_latest", gate):
        checkpointer.save(10, final=False)
        assert gate.reached.wait(HANG_GUARD_S)
        checkpointer.poll()  # publication held: not durable yet, and poll does not wait for it
        assert listener.durable_steps == []
        gate.release.set()
        checkpointer.manager.wait()  # the publication is complete (the trainer's steps go on meanwhile)
        assert listener.durable_steps == []
        checkpointer.poll()  # the next step's poll reports it
    assert listener.durable_steps == [10] and listener.published == [10]
    checkpointer.poll()  # reported once
    assert listener.durable_steps == [10]
    checkpointer.close()


def test_a_sharded_async_save_is_reported_the_same_way_with_the_digest_of_its_published_shards(one_rank_group,
                                                                                               tmp_path):
    """One durability path for full and sharded saves: the poll after its publication reports a sharded save too,
    with the digest streamed from what was published (unknown when the save returns)."""
    from sharded_support import fsdp_toy_model
    from worldpipe.checkpoint import checkpoint_digest
    from worldpipe.checkpoint.checkpointer import Checkpointer, Progress, TrainingComponents
    from worldpipe.parallel.runtime import Runtime

    model, opt = fsdp_toy_model()
    components = TrainingComponents(model, opt, None, _Loader(), Progress(step=10), {"run": "poll"})
    cfg = {"dir": str(tmp_path / "ck"), "every": 10, "keep_last": 2, "keep_every": None, "async_save": True,
           "verify": "first"}
    listener = _Listener()
    checkpointer = Checkpointer(cfg, Runtime(0, 1, 0, torch.device("cpu")), components, listener=listener)
    assert checkpointer.saver is not None
    gate = Gate()
    with hooked("after_latest", gate):
        assert checkpointer.save(10, final=False) is None
        assert gate.reached.wait(HANG_GUARD_S)
        checkpointer.poll()
        assert listener.durable_steps == []
        gate.release.set()
        checkpointer.manager.wait()
        checkpointer.poll()
    assert listener.durable_steps == [10] and listener.digests == [checkpoint_digest(cfg["dir"], 10)]
    assert checkpointer.save(20, final=True) == checkpoint_digest(cfg["dir"], 20)  # a final save: durable now
    assert listener.durable_steps == [10, 20]
    checkpointer.close()

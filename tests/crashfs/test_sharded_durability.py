"""Sharded checkpoints (every rank writes its own shards, rank 0 commits) under a simulated power cut: saves of
2 forked gloo ranks recorded on the crash-simulating file system, every state a cut could leave then resumed."""

from __future__ import annotations

import pytest

from crashfs.replay import checkpoint_acks, sweep
from sharded_support import on_forked_ranks
from worldpipe.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.crash

SAVE_AT = (1, 2, 3)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_every_cut_of_a_sharded_save_resumes_from_a_committed_step(crashfs, tmp_path, layout):
    root = crashfs.path / "run" / "checkpoints"
    on_forked_ranks(2, "train", root, tmp_path / "out.json", "--layout", layout, "--steps", str(max(SAVE_AT)),
                    "--save-at", ",".join(map(str, SAVE_AT)), tmp=tmp_path)
    recording = crashfs.recording()
    acked = checkpoint_acks(recording["log"], "run/checkpoints")
    assert sorted(acked) == list(SAVE_AT)
    reference = CheckpointManager(root, keep_last=3)
    expected = {step: reference.verify(step) == [] for step in SAVE_AT}
    assert all(expected.values())

    def check(run, state) -> None:
        durable = [s for s, at in acked.items() if at <= state.done]
        manager = CheckpointManager(run / "checkpoints", keep_last=3, verify="sha256")
        step = manager.latest_loadable()
        if durable:
            assert step is not None and step >= max(durable), (
                f"step {max(durable)} was committed durably, but resume takes {step}")
        if step is not None:
            assert (manager.store.read_manifest(step) == reference.store.read_manifest(step)), (
                f"step {step} resumes from another manifest than the one committed")

    result = sweep(recording, check, tmp_path, subdir="run")
    print(result.summary())

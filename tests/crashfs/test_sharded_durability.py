"""Sharded checkpoints (every rank writes its own shards, rank 0 commits) under a simulated power cut: saves of
2 gloo ranks under a real torchrun recorded on the crash-simulating file system, every state a cut could leave then resumed.
FSDP2 saves sync and async (published on every rank's writer thread), DDP sync. The default tier sweeps 3 saves
each; the slow tier 6 (retention deleting the oldest between them).

The ranks are fresh torchrun workers, not ranks forked from the test process: on CI (make test, xdist worker gw1)
ranks forked from a worker that had run other modules died with SIGSEGV mid-save, which no run here reproduced;
a fresh interpreter per rank carries none of the test process's state."""

from __future__ import annotations

import pytest

from crashfs.replay import checkpoint_acks, sweep
from sharded_support import torchrun
from worldpipe.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.crash

SIZES = [pytest.param(3, id="3-saves"), pytest.param(6, id="6-saves", marks=pytest.mark.slow)]


@pytest.mark.parametrize("saves", SIZES)
# fsdp2-async and ddp-sync between them take both writers and both layouts in the default tier.
@pytest.mark.parametrize(("layout", "mode"), [pytest.param("fsdp2", "sync", marks=pytest.mark.slow),
                                              ("fsdp2", "async"), ("ddp", "sync")])
def test_every_cut_of_a_sharded_save_resumes_from_a_committed_step(crashfs, tmp_path, env_with_venv, layout, mode,
                                                                   saves):
    root = crashfs.path / "run" / "checkpoints"
    save_at = tuple(range(1, saves + 1))
    done = torchrun(env_with_venv, 2, "train", root, tmp_path / "out.json", "--layout", layout, "--steps", saves,
                    "--save-at", ",".join(map(str, save_at)), *(["--async-save"] if mode == "async" else []))
    assert done.returncode == 0, done.stderr[-3000:]
    recording = crashfs.recording()
    acked = checkpoint_acks(recording["log"], "run/checkpoints")
    assert sorted(acked) == list(save_at)
    reference = CheckpointManager(root, keep_last=3)
    kept = {step: reference.store.read_manifest(step) for step in save_at if reference.verify(step) == []}
    assert sorted(kept) == list(save_at[-3:])

    def check(run, state) -> None:
        durable = [s for s, at in acked.items() if at <= state.done]
        manager = CheckpointManager(run / "checkpoints", keep_last=3, verify="sha256")
        step = manager.latest_loadable()
        if durable:
            assert step is not None and step >= max(durable), (
                f"step {max(durable)} was committed durably, but resume takes {step}")
        if step is not None and step in kept:
            assert manager.store.read_manifest(step) == kept[step], (
                f"step {step} resumes from another manifest than the one committed")

    result = sweep(recording, check, tmp_path, subdir="run")
    print(f"crashfs sharded checkpoints, {layout}, {mode}, {saves} saves: {result.summary()}")

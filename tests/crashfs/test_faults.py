"""Faults of the disk on the crash-simulating file system: a full file system part-way through a checkpoint and a
journal append, and an fsync that fails with EIO (after which Linux drops the dirty pages, so a second fsync of the
same descriptor would report success for nothing). The save fails loudly in one line, the previous checkpoint stays
intact and loadable, nothing is reported durable that is not, and no descriptor is fsynced again after its EIO."""

from __future__ import annotations

import errno
from multiprocessing.connection import Client

import pytest

from checkpoint_states import example_state
from crashfs.model import durable_after, write_image
from forked_ranks import run_on_ranks
from worldpipe.checkpoint.digest import state_digest
from worldpipe.checkpoint.errors import CheckpointWriteError
from worldpipe.checkpoint.manager import CheckpointManager
from worldpipe.tracking.spool import Spool

pytestmark = pytest.mark.crash


def no_fsync_after_eio(log: list[tuple]) -> None:
    """No descriptor whose fsync failed with EIO is fsynced again (its failure would be forgotten)."""
    failed = {}
    for index, op in enumerate(log):
        if op[0] == "fsync_eio":
            failed[op[1]] = op[2]
        elif op[0] == "fsync" and op[1] in failed:
            raise AssertionError(f"{failed[op[1]]} was fsynced again (operation {index}) after its fsync failed")


def after_power_cut(recording: dict, where) -> CheckpointManager:
    """The checkpoints a power cut right now would leave (the last crash state of the recording)."""
    write_image(durable_after(recording["initial"], recording["log"]), where)
    return CheckpointManager(where / "run" / "checkpoints", verify="sha256")


def assert_previous_survives(manager: CheckpointManager, step: int = 1) -> None:
    assert manager.latest_loadable() == step, f"the previous checkpoint (step {step}) is no longer the newest intact"
    assert state_digest(manager.load(step)) == state_digest(example_state(seed=step))
    assert manager.store.read_latest() == step


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, f"not one line: {text!r}"
    return text


@pytest.mark.parametrize("budget", [1000, 5000, 12000], ids=["first-file", "mid-files", "late"])
def test_a_full_file_system_mid_checkpoint_fails_the_save_and_keeps_the_previous_one(crashfs, tmp_path, budget):
    root = crashfs.path / "run" / "checkpoints"
    with CheckpointManager(root) as manager:
        manager.save(1, example_state(seed=1))
        crashfs.faults(space=budget)
        with pytest.raises(CheckpointWriteError) as failure:
            manager.save(2, example_state(seed=2))
    line = one_line(failure.value)
    assert "step 2" in line and "No space left on device" in line and str(root) in line, line
    crashfs.faults(space=None)
    live = CheckpointManager(root, verify="sha256")
    assert_previous_survives(live)
    assert [n for n in root.iterdir() if n.name.startswith(".step-")] == [], "the failed step left its files"
    assert_previous_survives(after_power_cut(crashfs.recording(), tmp_path / "cut"))
    with CheckpointManager(root) as manager:  # space again: the next save publishes
        manager.save(2, example_state(seed=2))
    assert live.latest_loadable() == 2


@pytest.mark.parametrize("nth", [1, 3, 7], ids=["first-file", "third-file", "manifest-or-later"])
def test_an_fsync_that_fails_with_eio_fails_the_save_and_is_never_retried(crashfs, tmp_path, nth):
    root = crashfs.path / "run" / "checkpoints"
    with CheckpointManager(root) as manager:
        manager.save(1, example_state(seed=1))
        crashfs.faults(eio_fsync=nth, eio_match="run/checkpoints/")
        with pytest.raises(CheckpointWriteError) as failure:
            manager.save(2, example_state(seed=2))
    line = one_line(failure.value)
    assert "step 2" in line and "Input/output error" in line, line
    recording = crashfs.recording()
    assert any(op[0] == "fsync_eio" for op in recording["log"]), "the fault did not fire"
    no_fsync_after_eio(recording["log"])
    crashfs.faults(eio_fsync=0)
    assert_previous_survives(CheckpointManager(root, verify="sha256"))
    assert_previous_survives(after_power_cut(recording, tmp_path / "cut"))


def two_sharded_saves_the_second_on_a_full_disk(root: str, control: str, budget: int) -> str | None:
    """On every forked rank: an FSDP2 model saved sharded as step 1, then (the disk filled to ``budget`` more
    bytes by rank 0 through the control socket) as step 2; the error line of step 2's save, if it failed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from sharded_support import fsdp_toy_model
    from worldpipe.checkpoint import capture_rng
    from worldpipe.checkpoint.sharded_saver import ShardedSaver

    model, optimizer = fsdp_toy_model()
    saver = ShardedSaver(CheckpointManager(root, keep_last=2))

    def state(step: int) -> dict:
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
                "progress": {"step": step, "epoch": 0, "samples_seen": step, "tokens_seen": 0},
                "sampler": {"cursor": step}, "rng": [capture_rng()], "identity": {"layout": "fsdp2"}}

    try:
        saver.save(1, state(1), optimizer)
        dist.barrier()
        if dist.get_rank() == 0:
            with Client(control, family="AF_UNIX") as conn:
                conn.send(("faults", {"space": budget}))
                conn.recv()
        dist.barrier()
        try:
            saver.save(2, state(2), optimizer)
        except CheckpointWriteError as exc:
            return one_line(exc)
        return None
    finally:
        saver.manager.close()


@pytest.mark.parametrize("budget", [100, 3000], ids=["first-shard", "part-way"])
def test_a_full_file_system_mid_sharded_save_fails_every_rank_and_keeps_the_previous_step(crashfs, tmp_path, budget):
    root = crashfs.path / "run" / "checkpoints"
    lines = run_on_ranks(2, two_sharded_saves_the_second_on_a_full_disk, str(root), crashfs.control, budget,
                         tmp=tmp_path / "ranks")
    assert all(line is not None and "step 2" in line for line in lines), lines
    assert any("No space left on device" in line for line in lines), lines
    crashfs.faults(space=None)
    for manager in (CheckpointManager(root, verify="sha256"),
                    after_power_cut(crashfs.recording(), tmp_path / "cut")):
        assert manager.latest_loadable() == 1 and manager.store.read_latest() == 1
    assert [n.name for n in root.iterdir() if n.name.startswith(".step-")] == [], "the failed step left its files"


def test_a_journal_append_on_a_full_disk_fails_and_loses_no_acknowledged_record(crashfs, tmp_path):
    spool = Spool(crashfs.path / "run")
    for step in range(3):
        spool.append("metrics", gate=step, metrics=[[step, "loss", 1.0 / (step + 1), 1000]])
    crashfs.faults(space=40)  # part of the next line fits, then the disk is full
    with pytest.raises(OSError) as failure:
        spool.append("metrics", gate=3, metrics=[[3, "loss", 0.25, 1000]] * 20)
    assert failure.value.errno == errno.ENOSPC
    crashfs.faults(space=None)
    assert [r["gate"] for r in spool.records()] == [0, 1, 2], "the failed append shows as a record"
    assert spool.append("commit", step=3) == 4, "the next append does not follow the last complete record"
    recording = crashfs.recording()
    write_image(durable_after(recording["initial"], recording["log"]), tmp_path / "cut")
    assert [r["seq"] for r in Spool(tmp_path / "cut" / "run").records()] == [1, 2, 3, 4]


def test_a_journal_fsync_that_fails_with_eio_fails_the_append_and_is_never_retried(crashfs, tmp_path):
    spool = Spool(crashfs.path / "run")
    spool.append("params", params={"a": "1"})
    crashfs.faults(eio_fsync=1, eio_match="journal.jsonl")
    with pytest.raises(OSError) as failure:
        spool.append("metrics", gate=1, metrics=[[1, "loss", 0.5, 1000]])
    assert failure.value.errno == errno.EIO
    crashfs.faults(eio_fsync=0)
    recording = crashfs.recording()
    no_fsync_after_eio(recording["log"])
    assert spool.append("commit", step=1) == 2, "the record whose fsync failed counts as appended"
    recording = crashfs.recording()
    write_image(durable_after(recording["initial"], recording["log"]), tmp_path / "cut")
    assert [r["op"] for r in Spool(tmp_path / "cut" / "run").records()] == ["params", "commit"]

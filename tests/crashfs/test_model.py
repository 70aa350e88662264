"""The crash-simulating file system's model on its own (no FUSE): what a cut keeps, tears and drops."""

from __future__ import annotations

import errno

import pytest

from crashfs.model import FsError, Model, crash_states, durable_after


def run(ops: list[tuple], model: Model | None = None) -> Model:
    model = model or Model()
    for op in ops:
        model.apply(op)
    return model


CREATE = [("mkdir", "d", 0o755), ("create", "d/f", 0o644, 1), ("write", 1, 0, b"x" * 5000)]


def test_data_is_durable_at_the_files_fsync_and_names_at_their_directorys():
    model = run(CREATE)
    assert model.durable_image() == {"": ("d",)}
    run([("fsync", 1, "d/f"), ("fsyncdir", "")], model)
    assert model.durable_image() == {"": ("d",), "d": ("d",)}, "a name made durable before its directory's fsync"
    run([("fsyncdir", "d")], model)
    assert model.durable_image()["d/f"] == ("f", b"x" * 5000)
    run([("write", 1, 5000, b"y"), ("rename", "d/f", "d/g")], model)
    assert model.durable_image()["d/f"] == ("f", b"x" * 5000), "unsynced data or a rename survived the cut"
    assert model.eager_names_image()["d/g"] == ("f", b"x" * 5000)


def test_a_cut_can_tear_the_last_write_at_sector_boundaries_or_keep_it_without_the_ones_before():
    log = [*CREATE, ("fsync", 1, "d/f"), ("fsyncdir", ""), ("fsyncdir", "d"),
           ("write", 1, 5000, b"a" * 100), ("write", 1, 5100, b"b" * 9000)]
    files = {s.image["d/f"][1] for s in crash_states({"": ("d",)}, log) if "d/f" in s.image}
    base = b"x" * 5000
    assert base + b"\0" * 100 + b"b" * (8192 - 5100) in files  # torn at 8 KiB, the earlier write lost: a hole
    assert base + b"\0" * 100 + b"b" * (5120 - 5100) in files  # torn at the first 512 B boundary
    assert base + b"\0" * 100 + b"b" * 9000 in files  # the last write whole, the one before it not
    assert base in files and len(files) == len(set(files))


def test_a_state_is_checked_against_the_latest_cut_that_leaves_it():
    log = [*CREATE, ("fsync", 1, "d/f"), ("release", 1), ("open", "d/f", 2), ("fsyncdir", "")]
    durable = [s for s in crash_states({"": ("d",)}, log) if s.kind == "durable"]
    # Nothing is durable until the root's fsync (the file's fsync before it left the file without a name), then
    # the directory: each is named by the latest cut that leaves it.
    assert [(s.done, sorted(s.image)) for s in durable] == [(6, [""]), (len(log), ["", "d"])]


def test_a_failed_fsync_drops_the_dirty_data_and_a_full_disk_writes_short():
    model = run(CREATE)
    model.faults.eio_fsync, model.faults.eio_match = 1, "d/f"
    with pytest.raises(FsError) as failure:
        model.apply(("fsync", 1, "d/f"))
    assert failure.value.errno == errno.EIO and bytes(model.handle(1).data) == b""
    model.apply(("fsync", 1, "d/f"))  # a second fsync "succeeds": the data is gone all the same
    assert durable_after({"": ("d",)}, model.log) == {"": ("d",)}
    model.faults.space = 10
    assert model.apply(("write", 1, 0, b"z" * 64)) == 10
    with pytest.raises(FsError) as full:
        model.apply(("write", 1, 10, b"z"))
    assert full.value.errno == errno.ENOSPC
    assert model.log[-1] == ("write", 1, 0, b"z" * 10), "the log keeps what reached the file"

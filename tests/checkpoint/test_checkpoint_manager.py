"""CheckpointManager on a real local filesystem: manifest, latest, retention, corruption (the round trip, a
half-written step, a flipped byte and a failed save are the store contract's, tests/checkpoint/test_store_contract.py)."""

import hashlib
import json
import os

import pytest
import torch

from checkpoint_states import example_state, flip_byte
from worldpipe.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointWriteError,
)


def _saved(root, steps, **kwargs):
    cm = CheckpointManager(root, **kwargs)
    for step in steps:
        state = example_state(seed=step)
        state["progress"]["step"] = step
        cm.save(step, state)
    return cm


def test_absent_parts_have_no_file_and_load_as_none(tmp_path):
    state = example_state(scheduler=False)
    CheckpointManager(tmp_path / "ck").save(1, state)
    names = set(os.listdir(tmp_path / "ck" / "step-000001"))
    assert names == {"MANIFEST.json", "model.pt", "optimizer.pt", "train_state.json", "identity.json", "rng"}
    loaded = CheckpointManager(tmp_path / "ck").load()
    assert loaded["scheduler"] is None and loaded["scaler"] is None and loaded["ema"] is None


def test_files_load_with_weights_only(tmp_path):
    CheckpointManager(tmp_path / "ck").save(1, example_state())
    for name in ("model.pt", "optimizer.pt", "scheduler.pt", "rng/rank-00000.pt"):
        torch.load(tmp_path / "ck" / "step-000001" / name, weights_only=True)


def test_manifest_lists_every_file_with_sha256(tmp_path):
    CheckpointManager(tmp_path / "ck").save(7, example_state(ranks=2))
    step_dir = tmp_path / "ck" / "step-000007"
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {"MANIFEST.json"}
    assert {f["path"] for f in manifest["files"]} == on_disk
    for entry in manifest["files"]:
        data = (step_dir / entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["step"] == 7 and manifest["identity"]["config_hash"] == "c0ffee"
    assert manifest["world_size"] == 2


def test_latest_points_at_newest(tmp_path):
    cm = _saved(tmp_path / "ck", [1, 2, 3])
    assert (tmp_path / "ck" / "latest").read_text() == "step-000003\n"
    infos = cm.list()
    assert [i.step for i in infos if i.is_latest] == [3]
    assert all(i.intact and i.problem is None and i.size_bytes > 0 for i in infos)


def test_keep_last(tmp_path):
    cm = _saved(tmp_path / "ck", range(1, 7), keep_last=3)
    assert [i.step for i in cm.list()] == [4, 5, 6]


def test_keep_every(tmp_path):
    cm = _saved(tmp_path / "ck", range(1, 11), keep_last=2, keep_every=4)
    assert [i.step for i in cm.list()] == [4, 8, 9, 10]


def test_keep_last_at_least_two(tmp_path):
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=1)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, verify="md5")


def test_retention_counts_only_intact_and_never_deletes_newer_steps(tmp_path):
    _saved(tmp_path / "ck", [1, 2, 9], keep_last=3)
    cm = CheckpointManager(tmp_path / "ck", keep_last=2)
    # step 2 is damaged: keep_last must still leave one intact fallback, so step 1 survives
    os.unlink(tmp_path / "ck" / "step-000002" / "model.pt")
    state = example_state(seed=5)
    cm.save(5, state)  # a run resumed from an earlier step: step 9 is not retention's to delete
    assert [i.step for i in cm.list()] == [1, 5, 9]


def test_damaged_manifest_is_detected(tmp_path):
    cm = _saved(tmp_path / "ck", [1, 2])
    path = tmp_path / "ck" / "step-000002" / "MANIFEST.json"
    path.write_text(path.read_text().replace('"c0ffee"', '"c0ffef"'))  # still valid JSON
    assert any("MANIFEST.json" in p for p in cm.verify(2))
    assert cm.latest_intact() == 1


def test_truncated_file_fails_size_check(tmp_path):
    cm = _saved(tmp_path / "ck", [1, 2], verify="size")
    with open(tmp_path / "ck" / "step-000002" / "model.pt", "r+b") as f:
        f.truncate(100)
    assert "model.pt" in cm.verify(2, full=False)[0]
    assert cm.latest_intact() == 1
    info = {i.step: i for i in cm.list()}
    assert not info[2].intact and "model.pt" in info[2].problem


def test_verify_first_hashes_once_per_process(tmp_path):
    _saved(tmp_path / "ck", [1])
    cm = CheckpointManager(tmp_path / "ck", verify="first")
    assert cm.load()["progress"]["step"] == 1  # sha256-verified now
    flip_byte(tmp_path / "ck" / "step-000001" / "model.pt", offset=-1)  # in the zip directory tail
    with pytest.raises(CheckpointCorruptError):
        CheckpointManager(tmp_path / "ck", verify="sha256").load(1)
    assert cm.verify(1) != []  # an explicit verify is always full


def test_partial_dir_never_listed_and_removed_by_next_save(tmp_path):
    cm = _saved(tmp_path / "ck", [1])
    leftover = tmp_path / "ck" / ".step-000002.partial-abc123"
    leftover.mkdir()
    (leftover / "model.pt").write_bytes(b"half")
    (tmp_path / "ck" / ".latest.tmp-00ff").write_text("step-000002\n")
    assert [i.step for i in cm.list()] == [1]
    assert cm.latest_intact() == 1
    cm.save(3, example_state())
    assert not leftover.exists() and not (tmp_path / "ck" / ".latest.tmp-00ff").exists()
    assert sorted(os.listdir(tmp_path / "ck")) == [".writer.lock", "latest", "step-000001", "step-000003"]


def test_step_dir_without_manifest_is_reported(tmp_path):
    cm = _saved(tmp_path / "ck", [1])
    (tmp_path / "ck" / "step-000002").mkdir()
    info = {i.step: i for i in cm.list()}
    assert not info[2].intact and "MANIFEST.json" in info[2].problem
    assert cm.latest_intact() == 1


def test_missing_and_empty(tmp_path):
    cm = CheckpointManager(tmp_path / "nothing")
    assert cm.list() == [] and cm.latest_intact() is None
    with pytest.raises(CheckpointNotFoundError):
        cm.load()
    _saved(tmp_path / "nothing", [1])
    with pytest.raises(CheckpointNotFoundError):
        cm.load(5)


def test_resave_same_step_replaces_it(tmp_path):
    cm = _saved(tmp_path / "ck", [1, 2])
    state = example_state(seed=99)
    cm.save(2, state)
    loaded = cm.load(2)
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert [i.step for i in cm.list()] == [1, 2]
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".step")]


def test_load_selected_keys(tmp_path):
    _saved(tmp_path / "ck", [1])
    loaded = CheckpointManager(tmp_path / "ck").load(keys={"rng", "progress"})
    assert loaded["model"] is None and loaded["progress"]["step"] == 1 and len(loaded["rng"]) == 1


def test_map_location_does_not_move_rng(tmp_path):
    _saved(tmp_path / "ck", [1])
    loaded = CheckpointManager(tmp_path / "ck").load(map_location="meta")
    assert loaded["model"]["0.weight"].device.type == "meta"
    assert loaded["rng"][0]["torch"].device.type == "cpu"


def test_second_writer_is_refused(tmp_path):
    import fcntl

    _saved(tmp_path / "ck", [1])
    fd = os.open(tmp_path / "ck" / ".writer.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another writer (the lock is per open file description)
        with pytest.raises(CheckpointWriteError, match="another process"):
            CheckpointManager(tmp_path / "ck").save(2, example_state())
    finally:
        os.close(fd)
    assert [i.step for i in CheckpointManager(tmp_path / "ck").list()] == [1]


def test_unknown_state_key_rejected(tmp_path):
    state = example_state()
    state["extra"] = 1
    with pytest.raises(ValueError, match="unknown state keys"):
        CheckpointManager(tmp_path / "ck").save(1, state)

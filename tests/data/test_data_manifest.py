"""Manifest: seal (atomic, reproducible), verify, corruption detection on read."""

import json
import os
from pathlib import Path

import pytest

from worldpipe.core import atomic as atomic_file
from worldpipe.data.build import build_dataset
from worldpipe.data.manifest import describe_dataset, load_manifest, seal_dataset, verify_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import CorruptShardError, TrajectoryStore, init_store, write_shards

pytestmark = pytest.mark.integration

SPEC = DatasetSpec(
    name="pend", env_id="Pendulum-v1", policy="random", episodes=6, max_steps=12, episodes_per_shard=2, seed=2
)
SHARD = "obs/c/1/0/0"


@pytest.fixture
def sealed(tmp_path):
    url = str(tmp_path / "store.zarr")
    mpath = str(tmp_path / "manifest.json")
    build_dataset(url, SPEC, mpath)
    return url, mpath


def _flip_byte(path, offset=20):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_manifest_content(sealed):
    url, mpath = sealed
    m = load_manifest(mpath)
    paths = [f["path"] for f in m["files"]]
    assert paths == sorted(paths)
    assert "zarr.json" in paths and SHARD in paths and "length/c/2" in paths
    assert m["spec"] == SPEC.to_dict()
    assert m["episodes"] == 6 and m["steps"] == 6 * 12
    assert m["arrays"]["obs"] == {
        "shape": [6, 12, 3],
        "dtype": "float32",
        "chunks": [1, 12, 3],
        "shards": [2, 12, 3],
    }
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in m["files"])
    assert all(r["status"] == "ok" for r in verify_dataset(url, mpath))


def test_reseal_is_byte_identical_and_leaves_no_temp_files(sealed, tmp_path):
    url, mpath = sealed
    first = Path(mpath).read_bytes()
    seal_dataset(url, mpath)
    assert Path(mpath).read_bytes() == first
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "store.zarr"]


def test_failed_seal_keeps_old_manifest_and_no_temp(sealed, tmp_path, monkeypatch):
    url, mpath = sealed
    first = Path(mpath).read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    # The crash point that matters: temp file written and fsynced, rename not yet done.
    monkeypatch.setattr(atomic_file.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        seal_dataset(url, mpath)
    monkeypatch.undo()
    assert Path(mpath).read_bytes() == first
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "store.zarr"]


@pytest.mark.parametrize("fast_decode", [True, False], ids=["direct", "zarr-codecs"])
def test_flipped_byte_is_reported_and_refused_on_read(sealed, fast_decode):
    url, mpath = sealed
    _flip_byte(os.path.join(url, SHARD))
    bad = [r for r in verify_dataset(url, mpath) if r["status"] != "ok"]
    assert [(r["path"], r["status"]) for r in bad] == [(SHARD, "mismatch")]
    store = TrajectoryStore.open(url, load_manifest(mpath), fast_decode=fast_decode)
    store.read_episodes(0, 2)  # shard 0 is intact
    with pytest.raises(CorruptShardError) as err:
        store.read_episodes(2, 4)
    assert SHARD in str(err.value) and err.value.path.endswith(SHARD)
    with pytest.raises(CorruptShardError):
        store.read_episodes(0, 6)


def test_corrupt_length_shard_is_refused_at_open(sealed):
    url, mpath = sealed
    _flip_byte(os.path.join(url, "length/c/0"), offset=0)
    with pytest.raises(CorruptShardError, match="length/c/0"):
        TrajectoryStore.open(url, load_manifest(mpath))


def test_missing_extra_and_size(sealed):
    url, mpath = sealed
    os.remove(os.path.join(url, "reward/c/2/0"))
    with open(os.path.join(url, "action/c/0/0/0"), "ab") as f:
        f.write(b"x")
    with open(os.path.join(url, "stray.bin"), "wb") as f:
        f.write(b"?")
    status = {r["path"]: r["status"] for r in verify_dataset(url, mpath)}
    assert status["reward/c/2/0"] == "missing"
    assert status["action/c/0/0/0"] == "size"
    assert status["stray.bin"] == "extra"
    assert sum(s != "ok" for s in status.values()) == 3
    store = TrajectoryStore.open(url, load_manifest(mpath))
    with pytest.raises(CorruptShardError, match="reward/c/2/0"):
        store.read_episodes(4, 6)


def test_tampered_manifest_is_rejected(sealed):
    _, mpath = sealed
    m = json.loads(Path(mpath).read_text())
    m["files"][0]["size"] += 1
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(ValueError, match="dataset_hash"):
        load_manifest(mpath)


def test_refuses_to_seal_incomplete_store(tmp_path):
    url = str(tmp_path / "s.zarr")
    init_store(url, SPEC)
    write_shards(url, SPEC, [0, 2], progress=False)
    with pytest.raises(ValueError, match="incomplete"):
        seal_dataset(url, str(tmp_path / "m.json"))
    assert not os.path.exists(tmp_path / "m.json")


def test_describe(sealed):
    url, mpath = sealed
    info = describe_dataset(url, mpath)
    assert info["episodes"] == 6 and info["steps"] == 72
    assert info["dataset_hash"] == load_manifest(mpath)["dataset_hash"]
    assert info["bytes_on_disk"] == sum(f["size"] for f in load_manifest(mpath)["files"])
    assert info["arrays"]["obs"]["shape"] == [6, 12, 3]
    assert describe_dataset(url, None)["dataset_hash"] is None
    json.dumps(info)

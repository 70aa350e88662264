"""The store, manifest and reads on s3:// through s3fs, against a local moto S3 server."""

import uuid

import pytest

from worldpipe.data.build import build_dataset
from worldpipe.data.loader import WindowLoader
from worldpipe.data.manifest import describe_dataset, load_manifest, verify_dataset
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import CorruptShardError, TrajectoryStore

pytestmark = pytest.mark.integration

SPEC = DatasetSpec(
    name="s3cp", env_id="CartPole-v1", policy="random", episodes=5, max_steps=20, episodes_per_shard=2, seed=4
)


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    import s3fs

    # Dummy credentials for the local fake server; never real ones.
    for var, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    options = {"client_kwargs": {"endpoint_url": moto_endpoint}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"wp-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    yield bucket, options, fs
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_s3_build_seal_verify_read(s3, tmp_path):
    bucket, options, fs = s3
    url = f"s3://{bucket}/data/{SPEC.name}/store.zarr"
    mpath = str(tmp_path / "manifest.json")
    s3_manifest = build_dataset(url, SPEC, mpath, storage_options=options)["manifest"]

    # The same dataset built locally has the same files and the same hash.
    local = build_dataset(str(tmp_path / "local.zarr"), SPEC, str(tmp_path / "local.json"))["manifest"]
    assert s3_manifest["dataset_hash"] == local["dataset_hash"]

    assert all(r["status"] == "ok" for r in verify_dataset(url, mpath, storage_options=options))
    store = TrajectoryStore.open(url, load_manifest(mpath), storage_options=options)
    local_store = TrajectoryStore.open(str(tmp_path / "local.zarr"))
    for key, value in store.read_episodes(0, 5).items():
        assert (value == local_store.read_episodes(0, 5)[key]).all(), key
    with WindowLoader(store, GlobalWindowSampler(store.lengths, 4, 2, 4, 0), 0, 1) as loader:
        assert loader.next_batch()["obs"].shape == (4, 4, 4)
    assert describe_dataset(url, mpath, storage_options=options)["episodes"] == 5

    # Corrupt one object: verify names it, reads refuse it.
    key = f"{bucket}/data/{SPEC.name}/store.zarr/action/c/1/0/0"
    data = bytearray(fs.cat_file(key))
    data[3] ^= 0x10
    fs.pipe_file(key, bytes(data))
    bad = [
        (r["path"], r["status"])
        for r in verify_dataset(url, mpath, storage_options=options)
        if r["status"] != "ok"
    ]
    assert bad == [("action/c/1/0/0", "mismatch")]
    store = TrajectoryStore.open(url, load_manifest(mpath), storage_options=options)
    with pytest.raises(CorruptShardError, match="action/c/1/0/0"):
        store.read_episodes(2, 4)


def test_s3_endpoint_from_environment(s3, tmp_path, monkeypatch):
    """Pipeline code passes no storage_options; botocore's AWS_ENDPOINT_URL must be enough."""
    import s3fs

    bucket, options, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"s3://{bucket}/env/store.zarr"
    build_dataset(url, SPEC, str(tmp_path / "m.json"))
    assert all(r["status"] == "ok" for r in verify_dataset(url, str(tmp_path / "m.json")))
    assert TrajectoryStore.open(url).lengths.size == 5

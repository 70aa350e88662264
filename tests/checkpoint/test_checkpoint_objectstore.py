"""Object-store protocol (fsspec): files first, MANIFEST.json last as the commit marker.

Runs on ``memory://`` and on a local moto S3 server through s3fs.
"""

import uuid

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError, state_digest


@pytest.fixture(params=["memory", "s3"])
def store(request, monkeypatch):
    """(root URL, storage_options, fsspec filesystem, path inside it) of a fresh, empty store."""
    if request.param == "memory":
        import fsspec

        name = f"ck-{uuid.uuid4().hex}"
        yield f"memory://{name}", {}, fsspec.filesystem("memory"), f"/{name}"
        return
    import s3fs

    endpoint = request.getfixturevalue("moto_endpoint")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"b{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    yield f"s3://{bucket}/run/checkpoints", options, fs, f"{bucket}/run/checkpoints"


def _manager(store, **kwargs):
    url, options, _, _ = store
    return CheckpointManager(url, storage_options=options, **kwargs)


def test_round_trip_and_latest(store):
    _, _, fs, path = store
    cm = _manager(store)
    states = {step: example_state(seed=step) for step in (1, 2, 3)}
    for step, state in states.items():
        cm.save(step, state)
    assert [i.step for i in cm.list()] == [2, 3]  # keep_last=2
    assert fs.cat_file(f"{path}/latest") == b"step-000003\n"
    loaded = _manager(store, verify="sha256").load()
    assert state_digest(loaded) == state_digest(states[3])
    assert torch.equal(loaded["rng"][0]["torch"], states[3]["rng"][0]["torch"])
    assert _manager(store).verify(3) == []


def test_step_without_manifest_is_invisible(store):
    _, _, fs, path = store
    cm = _manager(store, keep_last=3)
    cm.save(1, example_state(seed=1))
    cm.save(2, example_state(seed=2))
    fs.rm(f"{path}/step-000002/MANIFEST.json")  # as if the writer died before committing
    fs.invalidate_cache()
    assert fs.exists(f"{path}/step-000002/model.pt")
    assert [i.step for i in cm.list()] == [1]
    assert cm.latest_intact() == 1
    assert cm.load()["sampler"]["seed"] == 1
    cm.save(3, example_state(seed=3))  # the uncommitted leftovers are removed
    fs.invalidate_cache()
    assert not fs.exists(f"{path}/step-000002/model.pt")
    assert [i.step for i in cm.list()] == [1, 3]


def test_flipped_byte_detected(store):
    _, _, fs, path = store
    cm = _manager(store, verify="sha256")
    cm.save(1, example_state(seed=1))
    cm.save(2, example_state(seed=2))
    data = bytearray(fs.cat_file(f"{path}/step-000002/model.pt"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{path}/step-000002/model.pt", bytes(data))
    assert "step-000002/model.pt" in cm.verify(2)[0]
    assert cm.latest_intact() == 1


def test_failed_save_leaves_previous_latest(store, monkeypatch):
    _, _, fs, path = store
    cm = _manager(store)
    cm.save(1, example_state(seed=1))
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files:raise")
    with pytest.raises(CheckpointWriteError, match="step 2"):
        cm.save(2, example_state(seed=2))
    monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
    fs.invalidate_cache()
    assert not fs.exists(f"{path}/step-000002")
    assert fs.cat_file(f"{path}/latest") == b"step-000001\n"
    assert [i.step for i in cm.list()] == [1]

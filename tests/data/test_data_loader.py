"""WindowLoader on a real zarr store: exact resume across world sizes with prefetch, correct values."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldpipe.data.build import build_dataset
from worldpipe.data.loader import WindowLoader
from worldpipe.data.manifest import load_manifest
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import CorruptShardError, TrajectoryStore

pytestmark = pytest.mark.integration

SPEC = DatasetSpec(
    name="cp", env_id="CartPole-v1", policy="random", episodes=12, max_steps=30, episodes_per_shard=3, seed=9
)
WINDOW, STRIDE, GLOBAL_BATCH, SEED = 8, 4, 5, 3
HANG_GUARD_S = 120  # only stops a broken producer from hanging the suite; never a timing window


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    url, mpath = str(root / "store.zarr"), str(root / "manifest.json")
    build_dataset(url, SPEC, mpath)
    return url, mpath


@pytest.fixture(scope="module")
def store(dataset):
    return TrajectoryStore.open(dataset[0])


def _sampler(store, global_batch=GLOBAL_BATCH):
    return GlobalWindowSampler(store.lengths, WINDOW, STRIDE, global_batch, SEED)


def _loaders(store, world_size, state=None, **kw):
    loaders = [WindowLoader(store, _sampler(store), r, world_size, **kw) for r in range(world_size)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    return loaders


def _global_batches(loaders, n):
    """Run every rank for ``n`` batches; return per batch the rank slices concatenated in rank order."""
    out = []
    for _ in range(n):
        parts = [ld.next_batch() for ld in loaders]
        assert len({p["batch_index"] for p in parts}) == 1
        assert len({p["global_valid"] for p in parts}) == 1
        assert parts[0]["global_valid"] == int(sum(p["mask"].sum().item() for p in parts))
        assert sum(len(p["sample_index"]) for p in parts) == parts[0]["global_batch_size"]
        out.append({k: torch.cat([p[k] for p in parts]) for k in ("sample_index", "obs", "action", "mask")})
    return out


def _close(loaders):
    for ld in loaders:
        ld.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n1=st.integers(1, 4), n2=st.integers(1, 4), k=st.integers(0, 14), extra=st.integers(1, 10))
def test_loader_resume_across_world_sizes(store, n1, n2, k, extra):
    stats = store.obs_stats()
    ref_loaders = _loaders(store, n1, obs_stats=stats)
    first_loaders = _loaders(store, n1, obs_stats=stats)
    try:
        reference = _global_batches(ref_loaders, k + extra)
        first = _global_batches(first_loaders, k)
        state = first_loaders[n1 - 1].state_dict()  # any rank's state; prefetch has run ahead by now
        assert state == first_loaders[0].state_dict()
        resumed_loaders = _loaders(store, n2, state=state, obs_stats=stats)
        try:
            resumed = _global_batches(resumed_loaders, extra)
        finally:
            _close(resumed_loaders)
    finally:
        _close(ref_loaders + first_loaders)
    got = first + resumed
    for a, b in zip(got, reference, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    ids = torch.cat([g["sample_index"] for g in got])
    assert torch.equal(ids, torch.arange(ids.numel()))  # no repeat, no skip, across epochs


def test_values_match_store(store):
    stats = store.obs_stats()
    with WindowLoader(store, _sampler(store), 0, 1, obs_stats=stats) as loader:
        raw = store.read_episodes(0, store.num_episodes)
        sampler = _sampler(store)
        for _ in range(2 * sampler.batches_per_epoch):
            rows = sampler.next_global_batch()
            batch = loader.next_batch()
            assert batch["obs"].dtype == torch.float32 and batch["sample_index"].dtype == torch.int64
            assert torch.equal(batch["sample_index"], torch.from_numpy(rows[:, 0]))
            for i, (_, ep, start) in enumerate(rows):
                n = int(np.clip(store.lengths[ep] - start, 0, WINDOW))
                mask = batch["mask"][i].numpy()
                assert mask[:n].all() and not mask[n:].any()
                want = (raw["obs"][ep, start : start + n] - stats["obs_mean"]) / stats["obs_std"]
                np.testing.assert_allclose(batch["obs"][i, :n].numpy(), want, rtol=1e-5, atol=1e-5)
                assert not batch["obs"][i, n:].any() and not batch["reward"][i, n:].any()
                assert np.array_equal(batch["action"][i, :n].numpy(), raw["action"][ep, start : start + n])
                assert np.array_equal(
                    batch["terminated"][i, :n].numpy().astype(bool), raw["terminated"][ep, start : start + n]
                )


def test_prefetch_cache_and_path_do_not_change_batches(store):
    variants = [
        dict(prefetch=0),
        dict(prefetch=2),
        dict(prefetch=1, cache_bytes=1),  # LRU path that caches nothing
        dict(prefetch=3, cache_bytes=4000),  # LRU path with evictions
    ]
    runs = []
    for kw in variants:
        loaders = _loaders(store, 2, **kw)
        try:
            runs.append(_global_batches(loaders, 13))
        finally:
            _close(loaders)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_prefetch_never_advances_saved_state(store):
    sampler = _sampler(store)
    initial = sampler.state_dict()
    loader = WindowLoader(store, sampler, 0, 1, prefetch=3)
    try:
        queue = loader._queue
        with queue.not_empty:  # notified on every put: wake up until the prefetch queue is full
            full = queue.not_empty.wait_for(lambda: queue._qsize() >= queue.maxsize, timeout=HANG_GUARD_S)
        assert full, "the prefetch thread never filled its queue"
        assert loader.state_dict() == initial
        first = loader.next_batch()
        after_one = loader.state_dict()
        assert after_one["cursor"] == GLOBAL_BATCH and sampler.state_dict() == after_one
        loader.next_batch()
        loader.load_state_dict(after_one)  # rewind onto the same loader
        assert loader.next_batch()["batch_index"] == first["batch_index"] + 1
    finally:
        loader.close()


def test_epoch_tail_batch(store):
    sampler = _sampler(store, global_batch=7)
    tail = sampler.num_windows % 7 or 7
    with WindowLoader(store, sampler, 0, 3, prefetch=2) as loader:
        sizes = [loader.next_batch()["global_batch_size"] for _ in range(sampler.batches_per_epoch)]
        nxt = loader.next_batch()
    assert sizes[-1] == tail and all(s == 7 for s in sizes[:-1])
    assert nxt["epoch"] == 1 and nxt["batch_index"] == sampler.batches_per_epoch


def test_corrupt_shard_surfaces_from_prefetch_thread(dataset, tmp_path):
    url, mpath = dataset
    # Work on a copy so the module's dataset stays intact.
    copy = str(tmp_path / "copy.zarr")
    shutil.copytree(url, copy)
    shard = os.path.join(copy, "obs", "c", "2", "0", "0")
    data = bytearray(Path(shard).read_bytes())
    data[5] ^= 0xFF
    Path(shard).write_bytes(bytes(data))
    store = TrajectoryStore.open(copy, load_manifest(mpath))
    sampler = GlobalWindowSampler(store.lengths, WINDOW, STRIDE, 1000, SEED)  # one batch touches all shards
    with WindowLoader(store, sampler, 0, 1, prefetch=2) as loader:
        with pytest.raises(CorruptShardError) as err:
            loader.next_batch()
        assert err.value.path.endswith("obs/c/2/0/0")
        with pytest.raises(CorruptShardError):  # keeps failing, never hangs or yields garbage
            loader.next_batch()


def test_pixels_in_batches(tmp_path):
    spec = DatasetSpec(
        name="px",
        env_id="CartPole-v1",
        policy="noisy_controller",
        episodes=2,
        max_steps=10,
        episodes_per_shard=1,
        seed=0,
        pixels=True,
        pixel_size=8,
    )
    url = str(tmp_path / "px.zarr")
    build_dataset(url, spec)
    store = TrajectoryStore.open(url)
    with WindowLoader(store, GlobalWindowSampler(store.lengths, 4, 4, 3, 0), 1, 2) as loader:
        batch = loader.next_batch()
    assert batch["pixels"].shape == (1, 4, 8, 8, 3) and batch["pixels"].dtype == torch.uint8

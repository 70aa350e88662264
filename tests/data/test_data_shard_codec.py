"""Direct shard decoding gives exactly what zarr decodes, and refuses layouts it does not handle."""

import numpy as np
import pytest
import zarr

from worldpipe.data.build import build_dataset
from worldpipe.data.shard_cache import ShardCache
from worldpipe.data.shard_codec import ShardFormat, ShardFormatError
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import TrajectoryStore

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("compressor", ["zstd", "none"])
def test_fast_decode_matches_zarr(tmp_path, compressor):
    spec = DatasetSpec(
        name="c",
        env_id="CartPole-v1",
        policy="random",
        episodes=7,  # last shard is partial
        max_steps=15,
        episodes_per_shard=3,
        seed=1,
        pixels=True,
        pixel_size=8,
        compressor=compressor,
    )
    url = str(tmp_path / "s.zarr")
    build_dataset(url, spec)
    fast = TrajectoryStore.open(url)
    slow = TrajectoryStore.open(url, fast_decode=False)
    assert fast.fast_decode and not slow.fast_decode
    assert np.array_equal(fast.lengths, slow.lengths) and fast.lengths.dtype == slow.lengths.dtype
    for start, stop in [(0, 7), (2, 5), (6, 7), (3, 3)]:
        a, b = fast.read_episodes(start, stop), slow.read_episodes(start, stop)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (k, start, stop)
    stats_a, stats_b = fast.obs_stats(), slow.obs_stats()
    assert all(np.array_equal(stats_a[k], stats_b[k]) for k in stats_a)


def test_unhandled_layout_falls_back(tmp_path):
    arr = zarr.create_array(
        str(tmp_path / "a.zarr"),
        shape=(4, 5),
        chunks=(1, 5),
        shards=(2, 5),
        dtype="float32",
        compressors=None,
    )
    assert ShardFormat.from_array(arr) is not None
    gz = zarr.create_array(
        str(tmp_path / "b.zarr"),
        shape=(4, 5),
        chunks=(1, 5),
        shards=(2, 5),
        dtype="float32",
        compressors=[zarr.codecs.GzipCodec()],
    )
    assert ShardFormat.from_array(gz) is None
    plain = zarr.create_array(str(tmp_path / "c.zarr"), shape=(4, 5), chunks=(1, 5), dtype="float32")
    assert ShardFormat.from_array(plain) is None


def test_damaged_index_is_detected(tmp_path):
    arr = zarr.create_array(
        str(tmp_path / "a.zarr"), shape=(2, 3), chunks=(1, 3), shards=(2, 3), dtype="int32", compressors=None
    )
    arr[:] = np.arange(6, dtype=np.int32).reshape(2, 3)
    fmt = ShardFormat.from_array(arr)
    raw = bytearray((tmp_path / "a.zarr" / "c" / "0" / "0").read_bytes())
    assert np.array_equal(fmt.decode(bytes(raw), 2), arr[:])
    raw[-10] ^= 1  # inside the index
    with pytest.raises(ShardFormatError, match="checksum"):
        fmt.decode(bytes(raw), 2)
    assert not fmt.decode(None, 2).any()  # absent shard = fill value, as in zarr


def test_shard_cache_is_bounded():
    loads = []

    def load(i):
        loads.append(i)
        return {"x": np.zeros(10, np.float64)}  # 80 bytes

    cache = ShardCache(load, capacity=200)
    for i in [0, 1, 0, 2, 0, 3, 0]:
        cache.get(i)
        assert cache.nbytes <= 200
    assert loads == [0, 1, 2, 3]  # 0 stays hot; 1 then 2 evicted
    big = ShardCache(lambda i: {"x": np.zeros(100)}, capacity=10)
    big.get(0)
    big.get(0)
    assert big.nbytes == 0 and big.misses == 2

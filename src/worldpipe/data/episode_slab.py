"""Decoded episodes held in memory for fast window gathering.

Two strategies behind one interface:
- ``DenseSlab``: the whole decoded dataset fits in the cache budget, so shards are decoded into their
  slots of full-size arrays on first use and a batch is one fancy-index per array (as fast as numpy
  gathering from memory-mapped raw arrays);
- ``LruSlab``: otherwise, an LRU of decoded shards bounded by the budget, gathered shard by shard.
Both return identical values; only speed and memory differ.
"""

from __future__ import annotations

import numpy as np

from worldpipe.data.shard_cache import ShardCache
from worldpipe.data.store import TrajectoryStore, array_layout

STEP_KEYS = ("obs", "action", "reward", "terminated", "pixels")


def decoded_nbytes(store: TrajectoryStore) -> int:
    """Size of the whole dataset once decoded (per-step arrays only)."""
    return sum(
        int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        for a in array_layout(store.spec)
        if a.name in STEP_KEYS
    )


class DenseSlab:
    """Full-size arrays filled shard by shard on demand."""

    def __init__(self, store: TrajectoryStore, keys: tuple[str, ...]) -> None:
        self._store = store
        self._keys = keys
        shapes = {a.name: (a.shape, a.dtype) for a in array_layout(store.spec)}
        # np.zeros maps untouched pages lazily: memory grows only with the shards actually read.
        self._arrays = {k: np.zeros(*shapes[k]) for k in keys}
        self._loaded = np.zeros(store.num_shards, dtype=bool)
        self._per_shard = store.spec.episodes_per_shard

    def gather(self, episodes: np.ndarray, steps: np.ndarray) -> dict[str, np.ndarray]:
        """``{key: array[episodes[:, None], steps]}`` for every key (steps already clipped)."""
        shards = episodes // self._per_shard
        if not self._loaded[shards].all():
            for s in np.unique(shards[~self._loaded[shards]]):
                start, stop = self._store.spec.shard_range(int(s))
                data = self._store.read_shard(int(s))
                for k in self._keys:
                    self._arrays[k][start:stop] = data[k]
                self._loaded[s] = True
        rows = episodes[:, None]
        return {k: self._arrays[k][rows, steps] for k in self._keys}


class LruSlab:
    """Decoded shards in a byte-bounded LRU; gathers each shard's windows separately."""

    def __init__(self, store: TrajectoryStore, keys: tuple[str, ...], cache_bytes: int) -> None:
        self._store = store
        self._keys = keys
        self._per_shard = store.spec.episodes_per_shard
        self.cache = ShardCache(store.read_shard, cache_bytes)
        self._shapes = {a.name: (a.shape[2:], a.dtype) for a in array_layout(store.spec)}

    def gather(self, episodes: np.ndarray, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Same contract as ``DenseSlab.gather``."""
        b, t = steps.shape
        out = {k: np.zeros((b, t, *self._shapes[k][0]), self._shapes[k][1]) for k in self._keys}
        shards = episodes // self._per_shard
        for s in np.unique(shards):
            sel = np.nonzero(shards == s)[0]
            data = self.cache.get(int(s))
            rows = (episodes[sel] - int(s) * self._per_shard)[:, None]
            for k in self._keys:
                out[k][sel] = data[k][rows, steps[sel]]
        return out


def make_slab(store: TrajectoryStore, keys: tuple[str, ...], cache_bytes: int) -> DenseSlab | LruSlab:
    """Dense when the decoded dataset fits in ``cache_bytes``, else an LRU of shards."""
    if decoded_nbytes(store) <= cache_bytes:
        return DenseSlab(store, keys)
    return LruSlab(store, keys, cache_bytes)

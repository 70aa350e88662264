"""Prepared episodes held in memory for fast window gathering.

Shards are loaded through a ``load(shard_index)`` callable that returns per-episode arrays of shape
``[n, T + 1, ...]``, already normalised, zero beyond each episode's length, and with one extra all-zero
step at ``T``: a window step past the stored horizon is gathered from that step, so a batch needs no
per-element masking arithmetic, only one fancy index per array.

Two strategies behind one interface:
- ``DenseSlab``: the prepared dataset fits in the cache budget, so shards are placed in their slots of
  full-size arrays on first use and a batch is one gather per array;
- ``LruSlab``: otherwise, an LRU of prepared shards bounded by the budget, gathered shard by shard.
Both return identical values; only speed and memory differ.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from worldpipe.data.shard_cache import ShardCache

Shapes = dict[str, tuple[tuple[int, ...], np.dtype]]  # key -> (per-episode shape incl. T + 1, dtype)
Loader = Callable[[int], dict[str, np.ndarray]]


def prepared_nbytes(num_episodes: int, shapes: Shapes) -> int:
    """Bytes of the whole prepared dataset."""
    return sum(
        num_episodes * int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values()
    )


class DenseSlab:
    """Full-size arrays filled shard by shard on demand."""

    def __init__(self, num_episodes: int, episodes_per_shard: int, load: Loader, shapes: Shapes) -> None:
        self._load = load
        self._per_shard = episodes_per_shard
        # np.zeros maps untouched pages lazily: memory grows only with the shards actually loaded.
        self._arrays = {k: np.zeros((num_episodes, *shape), dtype) for k, (shape, dtype) in shapes.items()}
        self._loaded = np.zeros(-(-num_episodes // episodes_per_shard), dtype=bool)

    def gather(self, episodes: np.ndarray, steps: np.ndarray) -> dict[str, np.ndarray]:
        """``{key: array[episodes[:, None], steps]}`` for every key."""
        shards = episodes // self._per_shard
        if not self._loaded[shards].all():
            for s in np.unique(shards[~self._loaded[shards]]).tolist():
                start = s * self._per_shard
                for k, v in self._load(s).items():
                    self._arrays[k][start : start + len(v)] = v
                self._loaded[s] = True
        rows = episodes[:, None]
        return {k: a[rows, steps] for k, a in self._arrays.items()}


class LruSlab:
    """Prepared shards in a byte-bounded LRU; gathers each shard's windows separately."""

    def __init__(self, episodes_per_shard: int, load: Loader, shapes: Shapes, cache_bytes: int) -> None:
        self._per_shard = episodes_per_shard
        self._shapes = shapes
        self.cache = ShardCache(load, cache_bytes)

    def gather(self, episodes: np.ndarray, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Same contract as ``DenseSlab.gather``."""
        b, t = steps.shape
        out = {k: np.empty((b, t, *shape[1:]), dtype) for k, (shape, dtype) in self._shapes.items()}
        shards = episodes // self._per_shard
        for s in np.unique(shards).tolist():
            sel = np.nonzero(shards == s)[0]
            data = self.cache.get(s)
            rows = (episodes[sel] - s * self._per_shard)[:, None]
            for k in out:
                out[k][sel] = data[k][rows, steps[sel]]
        return out


def make_slab(
    num_episodes: int, episodes_per_shard: int, load: Loader, shapes: Shapes, cache_bytes: int
) -> DenseSlab | LruSlab:
    """Dense when the prepared dataset fits in ``cache_bytes``, else an LRU of shards."""
    if prepared_nbytes(num_episodes, shapes) <= cache_bytes:
        return DenseSlab(num_episodes, episodes_per_shard, load, shapes)
    return LruSlab(episodes_per_shard, load, shapes, cache_bytes)

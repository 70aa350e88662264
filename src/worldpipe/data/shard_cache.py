"""LRU cache of decoded shards, bounded by bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

Shard = dict[str, np.ndarray]


def shard_nbytes(shard: Shard) -> int:
    """Decoded size of a shard."""
    return sum(int(v.nbytes) for v in shard.values())


class ShardCache:
    """Keeps the most recently used decoded shards while their total size stays within ``capacity``.

    A shard larger than the whole capacity is returned but not kept. Not thread-safe: the loader uses it
    from a single producer thread.
    """

    def __init__(self, load: Callable[[int], Shard], capacity: int) -> None:
        self._load = load
        self.capacity = int(capacity)
        self._items: OrderedDict[int, Shard] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, index: int) -> Shard:
        """The decoded shard ``index``, loading (and evicting the least recent) as needed."""
        shard = self._items.get(index)
        if shard is not None:
            self._items.move_to_end(index)
            self.hits += 1
            return shard
        self.misses += 1
        shard = self._load(index)
        size = shard_nbytes(shard)
        if size <= self.capacity:
            while self._items and self.nbytes + size > self.capacity:
                _, old = self._items.popitem(last=False)
                self.nbytes -= shard_nbytes(old)
            self._items[index] = shard
            self.nbytes += size
        return shard

    def clear(self) -> None:
        """Drop every cached shard."""
        self._items.clear()
        self.nbytes = 0

"""Result cache keyed by the complete identity of a draw; also holds the states of action prefixes.

Key = (model version, initial-state hash, action-prefix hash, sampling-config hash, RNG stream identity).
The action-prefix hash is a chain (h_0 = hash of nothing, h_k = sha256(h_{k-1} || a_{k-1})), so a request can
find the longest cached prefix of its actions and continue from that prefix's state instead of starting over.
Only reproducible draws are stored or looked up: a fresh sample has a stream id nobody used before.
Bounded by entries and bytes; least recently used entries go first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from worldpipe.models import RolloutState, state_nbytes

_EMPTY_PREFIX = hashlib.sha256(b"worldpipe-action-prefix-v1").hexdigest()


def tensor_hash(*tensors: torch.Tensor) -> str:
    """SHA-256 over dtype, shape and bytes of the tensors (the initial-state hash of a context)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prefix_hashes(actions: torch.Tensor) -> list[str]:
    """[h_0, h_1, ..., h_H]: h_k identifies the first k actions of ``actions`` [H, A]."""
    hashes = [_EMPTY_PREFIX]
    rows = actions.detach().cpu().contiguous().to(torch.float32)
    for row in rows:
        hashes.append(hashlib.sha256(bytes.fromhex(hashes[-1]) + row.numpy().tobytes()).hexdigest())
    return hashes


@dataclass(frozen=True)
class DrawKey:
    """Everything that determines a draw except the action prefix."""

    model_version: str
    initial_state: str
    sampling: str
    stream: str  # StreamId.key(), or "mean" for noise-free rollouts

    def at(self, prefix: str) -> tuple:
        """The full cache key for one action prefix."""
        return (self.model_version, self.initial_state, prefix, self.sampling, self.stream)


@dataclass
class CachedDraw:
    """Outputs for the first k actions and the rollout state after them."""

    obs: torch.Tensor  # [k, O]
    reward: torch.Tensor  # [k]
    state: RolloutState

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state) + self.obs.numel() * self.obs.element_size() + \
            self.reward.numel() * self.reward.element_size()


class ResultCache:
    """Thread-safe LRU map from full draw keys to :class:`CachedDraw`."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple, CachedDraw] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.prefix_hits = self.misses = 0

    def longest_prefix(self, key: DrawKey, hashes: list[str]) -> tuple[int, CachedDraw] | None:
        """(k, entry) for the longest cached prefix h_k of ``hashes`` (k may be 0: the context alone)."""
        with self._lock:
            for k in range(len(hashes) - 1, -1, -1):
                entry = self._entries.get(key.at(hashes[k]))
                if entry is not None:
                    self._entries.move_to_end(key.at(hashes[k]))
                    if k == len(hashes) - 1:
                        self.hits += 1
                    else:
                        self.prefix_hits += 1
                    return k, entry
            self.misses += 1
            return None

    def put(self, key: DrawKey, prefix: str, draw: CachedDraw) -> None:
        """Store ``draw`` under the full key; evict least recently used entries beyond the bounds."""
        if draw.nbytes > self.max_bytes:
            return
        full = key.at(prefix)
        with self._lock:
            old = self._entries.pop(full, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[full] = draw
            self._bytes += draw.nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def stats(self) -> dict:
        """Entries, bytes and hit counters."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits,
                    "prefix_hits": self.prefix_hits, "misses": self.misses}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

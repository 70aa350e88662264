"""Memory by category: parameters, rollout state, activations (peak live tensors during a call), overhead.

Activations are measured, not estimated: :class:`LiveTensorPeak` watches every tensor the operators inside a
call create (a TorchDispatchMode) and tracks the peak of the bytes still alive. Runtime overhead is the process
RSS minus the tensor bytes accounted for in the other categories.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def process_rss_bytes() -> int | None:
    """Resident set size of this process (None where /proc is not available)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of tensors created inside the ``with`` block and still alive, counted per storage."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

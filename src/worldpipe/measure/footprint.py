"""What an object graph really holds in this process: its tensors' allocations plus their per-tensor overhead, and
its Python objects.

A small tensor costs far more than its ``nbytes``: the Python wrapper, the C++ TensorImpl and StorageImpl, and the
allocator's rounding. A rollout session holding a 64-byte recurrent state holds a few KiB, so a memory budget
counted in ``nbytes`` alone would let a server grow a hundred times past it. The per-tensor overhead is measured
once per process (the C heap in use around allocating many tensors, :func:`tensor_overhead_bytes`); Python
objects are counted with ``sys.getsizeof``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
from collections.abc import Mapping
from typing import Any

import torch

from worldpipe.measure.memory import process_rss_bytes

_ALIGNMENT = 64  # PyTorch's CPU allocator aligns every tensor allocation to 64 bytes
_GC_HEADER = 16  # bytes CPython puts before every object the cycle collector tracks (not in getsizeof)
_CALIBRATION_TENSORS = 4096


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> Any:
    """A function returning the C heap's bytes in use (glibc ``mallinfo2``), or None where there is none."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return lambda: int(libc.mallinfo2().uordblks)


@functools.cache
def tensor_overhead_bytes() -> int | None:
    """Bytes one CPU tensor costs beyond its data allocation: measured once, None where nothing can measure it.

    Measured on the C heap (glibc ``mallinfo2``) around allocating many one-element tensors, else from the
    resident set size; plus the Python wrapper object.
    """
    heap = _heap_in_use()
    measure = heap or process_rss_bytes
    gc.collect()
    before = measure()
    if before is None:
        return None
    keep = [torch.empty(1) for _ in range(_CALIBRATION_TENSORS)]
    after = measure()
    per_tensor = (after - before) / len(keep) - _data_bytes(keep[0]) - 8  # 8: the list's slot
    python = sys.getsizeof(keep[0]) + _GC_HEADER if heap is not None else 0  # the RSS already holds it
    del keep
    return max(0, round(per_tensor)) + python


def _data_bytes(tensor: torch.Tensor) -> int:
    nbytes = tensor.untyped_storage().nbytes()
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def footprint_bytes(obj: Any, shared: tuple = ()) -> int:
    """Bytes ``obj`` holds in this process: every tensor it reaches (each storage once, a view's base too) with
    its measured overhead, and every Python object it reaches. Objects in ``shared`` (and what only they reach)
    are not counted: they are someone else's."""
    seen: set[int] = {id(s) for s in shared}
    storages: set[int] = set()
    overhead = tensor_overhead_bytes() or 0
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += overhead
            storage = item.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += _data_bytes(item)
            if item._base is not None:
                stack.append(item._base)
            continue
        total += sys.getsizeof(item) + (_GC_HEADER if gc.is_tracked(item) else 0)
        stack.extend(_children(item))
    return total


def _children(item: Any) -> list:
    if isinstance(item, Mapping):
        return [*item.keys(), *item.values()]
    if isinstance(item, list | tuple | set | frozenset):
        return list(item)
    if isinstance(item, str | bytes | int | float | bool) or item is None:
        return []
    children = [getattr(item, "__dict__", None)] if hasattr(item, "__dict__") else []
    children += [getattr(item, name, None) for name in getattr(type(item), "__slots__", ())]
    return [c for c in children if c is not None]

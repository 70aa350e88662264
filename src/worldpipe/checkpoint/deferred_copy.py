"""The background copy of an async checkpoint's parameters and optimizer state.

Parameters and optimizer state change only inside ``optimizer.step()``. So the snapshot copy of those tensors
need not stall the loop: it runs on a thread while the next step's forward and backward run, and only has to
be complete before that step's optimizer update. :func:`step_mutated` says which tensors qualify (their storage
belongs to a parameter or a per-parameter state tensor of the optimizer); everything else (buffers, RNG
states, anything a forward pass may change) is still copied synchronously, so correctness never depends on
the trainer's order of calls beyond "the copy is awaited before ``optimizer.step()``", which a step pre-hook
enforces (:func:`guard_optimizer`). A small state (below :data:`DEFER_MIN_BYTES`) is copied at once instead: there
the deferral costs the steps more than the copy it defers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .thread_pool import LazyThreadPool


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's storage is its local shard's
    return to_local() if callable(to_local) else t


def _storage_ptr(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


# Below this many bytes of parameters and optimizer state, the training thread copies them itself, with the rest of
# the snapshot. Handing a small copy to the copy thread costs more than the copy: on the smoke model (~180 KB) an
# async save's step took 11.9-12.2 ms with the deferred copy and 10.8-11.0 ms without (trace events, 2 runs of
# 9 saves each, alternated); a copy of 16 MiB takes a few ms, about what deferring it costs.
DEFER_MIN_BYTES = 16 << 20


def step_mutated(optimizer: torch.optim.Optimizer,
                 min_bytes: int | None = None) -> Callable[[torch.Tensor], bool] | None:
    """Predicate: does ``tensor`` share storage with what ``optimizer.step()`` writes (params, their state)?

    None (copy everything now) when those tensors hold fewer than ``min_bytes`` (default :data:`DEFER_MIN_BYTES`).
    """
    sizes: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            sizes[_storage_ptr(p)] = _local(p).untyped_storage().nbytes()
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                sizes[_storage_ptr(value)] = _local(value).untyped_storage().nbytes()
    sizes.pop(0, None)
    if sum(sizes.values()) < (DEFER_MIN_BYTES if min_bytes is None else min_bytes):
        return None
    ptrs = set(sizes)
    return lambda t: _storage_ptr(t) in ptrs


_COPY_POOL = LazyThreadPool("ckpt-snapshot-copy", max_workers=1)


def copy_pool() -> ThreadPoolExecutor:
    """The process-wide copy thread (one: copies of a snapshot run in order)."""
    return _COPY_POOL.get()


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(_local(src))
    pairs.clear()  # drop references to the live tensors


class DeferredCopy:
    """Copies ``(destination, source)`` pairs on the copy thread (``copy_`` releases the GIL)."""

    def __init__(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._future = copy_pool().submit(_copy_all, list(pairs))

    @property
    def done(self) -> bool:
        """True once every copy has finished."""
        return self._future.done()

    def wait(self) -> None:
        """Block until every copy has finished; raise the copy's failure, if any."""
        self._future.result()


def guard_optimizer(optimizer: torch.optim.Optimizer, wait: Callable[[], None]):
    """Call ``wait()`` before every ``optimizer.step()``; returns the hook handle (``.remove()`` to undo)."""
    return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: wait())

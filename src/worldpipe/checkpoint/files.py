"""Background fsync for checkpoint writers (the write and fsync primitives themselves are in core.atomic)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .thread_pool import LazyThreadPool

_FSYNC_POOL = LazyThreadPool("ckpt-fsync", max_workers=2)


def fsync_pool() -> ThreadPoolExecutor:
    """Threads that fsync finished files while the next ones are being written (device I/O overlaps)."""
    return _FSYNC_POOL.get()

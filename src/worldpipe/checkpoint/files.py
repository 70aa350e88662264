"""Background fsync for checkpoint writers (the write and fsync primitives themselves are in core.atomic)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .thread_pool import LazyThreadPool, in_background

_FSYNC_POOL = LazyThreadPool("ckpt-fsync", max_workers=2)
_BACKGROUND_FSYNC_POOL = LazyThreadPool("ckpt-fsync-bg", max_workers=2, background=True)


def fsync_pool() -> ThreadPoolExecutor:
    """Threads that fsync finished files while the next ones are being written (device I/O overlaps).

    Asked from a background thread (an async save), the background-priority ones.
    """
    return (_BACKGROUND_FSYNC_POOL if in_background() else _FSYNC_POOL).get()

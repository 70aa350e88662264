"""Durable file writes shared by every writer of checkpoint files: whole writes, fsync, fsync off-thread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from worldpipe.core.atomic import fsync_dir

from .tensorfile import Segment
from .thread_pool import LazyThreadPool

_MAX_WRITE = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below


def write_all(fd: int, segment: Segment) -> None:
    """Write all of ``segment`` to ``fd`` (large writes, partial writes resumed)."""
    view = memoryview(segment).cast("B")
    while len(view):
        written = os.write(fd, view[:_MAX_WRITE])
        view = view[written:]


def write_file(path: str, segments: list[Segment]) -> int:
    """Create ``path`` (must not exist), write ``segments``; return the open descriptor (not yet fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for seg in segments:
            write_all(fd, seg)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_and_close(fd: int) -> None:
    """``fsync`` then close ``fd`` (closed even when fsync fails)."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, segments: list[Segment]) -> None:
    """Create ``path`` (must not exist), write ``segments``, ``fsync`` it, close it."""
    fsync_and_close(write_file(path, segments))


_FSYNC_POOL = LazyThreadPool("ckpt-fsync", max_workers=2)


def fsync_pool() -> ThreadPoolExecutor:
    """Threads that fsync finished files while the next ones are being written (device I/O overlaps)."""
    return _FSYNC_POOL.get()


__all__ = ["fsync_and_close", "fsync_dir", "fsync_pool", "write_all", "write_file", "write_file_durably"]

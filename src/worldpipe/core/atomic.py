"""Durable, atomic writes: the one home of the write → fsync → rename → fsync-directory protocol.

Atomicity (readers see the old or the new name, never a torn one) comes from ``rename`` within one directory;
durability (it survives power loss) from fsyncing the file before the rename and the directory after it. Every
writer in worldpipe that publishes a file or a directory (checkpoints, manifests, the tracking spool, run
records, the ``latest`` links) goes through these functions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable
from typing import Any

_MAX_WRITE = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so the names it holds (creations, renames, removals) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durably(path: str | os.PathLike) -> None:
    """Create ``path`` and its missing parents (like ``os.makedirs(exist_ok=True)``) so that each new directory's
    name survives a power cut: each one's parent is fsynced after it is made. Existing directories cost nothing."""
    missing = []
    path = os.path.abspath(os.fspath(path))
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        fsync_dir(os.path.dirname(path))


def fsync_ancestors(path: str | os.PathLike) -> None:
    """fsync every directory above ``path`` up to the file system's root, so that the names leading to it are
    durable whoever created them (a store that made its directories without fsyncing their parents)."""
    path = os.path.abspath(os.fspath(path))
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        fsync_dir(parent)
        path = parent


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (bottom-up), making its current contents durable."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            fsync_and_close(fd)
        fsync_dir(dirpath)


def write_all(fd: int, buffer: Any) -> None:
    """Write all of ``buffer`` (anything with the buffer protocol) to ``fd``, resuming partial writes."""
    view = memoryview(buffer).cast("B")
    while len(view):
        written = os.write(fd, view[:_MAX_WRITE])
        view = view[written:]


def write_file(path: str | os.PathLike, buffers: Iterable[Any]) -> int:
    """Create ``path`` (must not exist), write ``buffers``; return the open descriptor (not yet fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for buffer in buffers:
            write_all(fd, buffer)
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


def write_file_durably(path: str | os.PathLike, buffers: Iterable[Any]) -> None:
    """Create ``path`` (must not exist), write ``buffers``, ``fsync`` it, close it."""
    fsync_and_close(write_file(path, buffers))


def append_durably(path: str | os.PathLike, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if absent) and ``fsync`` it before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_beside(path: str | os.PathLike) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex}")


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync the directory.

    On any error the temp file is removed and ``path`` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _temp_beside(path)
    try:
        write_file_durably(tmp, [data])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """write_atomic for UTF-8 text."""
    write_atomic(path, text.encode())


def symlink_atomic(link: str | os.PathLike, target: str) -> None:
    """Point the symlink ``link`` at ``target`` (created or replaced atomically), then fsync its directory."""
    tmp = _temp_beside(link)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(link)))


def publish_dir(partial: str | os.PathLike, final: str | os.PathLike, aside: str | os.PathLike) -> None:
    """Rename the fully written, fsynced directory ``partial`` to ``final`` and fsync the parent.

    An existing ``final`` is first renamed to ``aside`` (a hidden name in the same directory) and removed once
    the new one is durable, so readers see the old directory or the new one, never neither or a mix.
    """
    moved = False
    if os.path.lexists(final):
        os.rename(final, aside)
        moved = True
    os.rename(partial, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    if moved:
        shutil.rmtree(aside, ignore_errors=True)


def remove_atomic(path: str | os.PathLike, aside: str | os.PathLike) -> bool:
    """Remove a file or directory so that readers see it whole or not at all, durably; False if absent.

    A directory is first renamed to ``aside`` (a hidden name in the same directory), the parent fsynced, and only
    then deleted; a file is unlinked and the parent fsynced.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        os.rename(path, aside)
        fsync_dir(parent)
        shutil.rmtree(aside)
        fsync_dir(parent)
        return True
    if os.path.lexists(path):
        os.unlink(path)
        fsync_dir(parent)
        return True
    return False

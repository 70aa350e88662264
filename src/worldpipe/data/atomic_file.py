"""Atomic, durable small-file publication (temp file in the same directory, fsync, rename, fsync dir)."""

from __future__ import annotations

import contextlib
import os
import uuid


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new file, never a mix.

    Atomicity comes from ``os.replace`` within one directory; durability from fsyncing the file before
    the rename and the directory after it. On any error the temp file is removed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (bottom-up), making its current contents durable."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)

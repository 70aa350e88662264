"""Small-file publication: readers see the old or the new file, never a torn one, and it survives power loss.

Atomicity comes from ``os.replace`` within one directory; durability from fsyncing the file before the rename
and the directory after it.
"""

from __future__ import annotations

import contextlib
import os
import uuid


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so the names it holds (creations, renames, removals) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (bottom-up), making its current contents durable."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync the directory.

    On any error the temp file is removed and ``path`` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """write_atomic for UTF-8 text."""
    write_atomic(path, text.encode())

"""The raw-write baseline of the checkpoint benchmarks: the tensors' bytes, large writes, fsync, nothing else.

A checkpoint writer is compared with this limit, measured in the same run on the same bytes: one file per
part (per process, or per rank in the sharded rows), no serialization, no hashing, no manifest, no rename.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from worldpipe.core.atomic import fsync_and_close, fsync_dir, write_file


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in a nested structure of dicts, lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from tensors_in(value)


def state_bytes(obj) -> int:
    """Total bytes of the tensors in a nested structure (each tensor's own elements)."""
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def write_raw(directory: str | os.PathLike, files: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """Write each named file's tensors back to back into ``directory``, fsync every file, then the directory.

    The files must not exist. Tensors must be contiguous CPU tensors (their bytes are written as they are).
    """
    for name, tensors in files.items():
        fd = write_file(str(Path(directory) / name), [memoryview(t.numpy()).cast("B") for t in tensors])
        fsync_and_close(fd)
    fsync_dir(directory)


DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write: large and a multiple of any logical block size


def write_direct(directory: str | os.PathLike, nbytes: int, writers: int = 1) -> None:
    """The device's limit: ``nbytes`` written with O_DIRECT by ``writers`` threads, one file each, then fsync.

    O_DIRECT bypasses the page cache, so this measures what the device (not memory) accepts; the bytes come
    from one page-aligned buffer (O_DIRECT needs aligned memory, offsets and sizes), each file rounded up to
    whole pages. Raises OSError where the file system refuses O_DIRECT (e.g. tmpfs).
    """

    per_file = -(-max(1, nbytes) // writers)
    chunk = min(DIRECT_CHUNK, -(-per_file // mmap.PAGESIZE) * mmap.PAGESIZE)
    buffer = mmap.mmap(-1, chunk)  # anonymous mappings are page-aligned
    buffer.write(os.urandom(chunk))
    view = memoryview(buffer)
    chunks_per_file = -(-per_file // chunk)

    def one(index: int) -> None:
        path = Path(directory) / f"direct-{index}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            for _ in range(chunks_per_file):
                os.write(fd, view)  # releases the GIL: the writers run in parallel
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(one, range(writers)))
        fsync_dir(directory)
    finally:
        view.release()
        buffer.close()

"""core.atomic's gathered writes: every byte of every buffer, in order, however the kernel splits the writes."""

import os

import numpy as np
import pytest
import torch

from worldpipe.core import atomic


def _buffers():
    """More buffers than one writev call takes, of mixed kinds and sizes (empty ones included)."""
    generator = torch.Generator().manual_seed(0)
    buffers = []
    for index in range(2500):
        size = int(torch.randint(0, 300, (1,), generator=generator))
        if index % 3 == 0:
            buffers.append(bytes(range(256)) * (size // 256) + bytes(size % 256))
        elif index % 3 == 1:
            buffers.append(memoryview(torch.rand(size // 4 + 1, generator=generator).numpy()).cast("B"))
        else:
            buffers.append(np.full(size, index % 251, dtype=np.uint8))
    return buffers


def _expected(buffers):
    return b"".join(memoryview(b).cast("B").tobytes() for b in buffers)


def test_write_file_writes_every_buffer_in_order_beyond_one_writev_call(tmp_path):
    buffers = _buffers()
    assert len(buffers) > atomic._IOV_MAX
    fd = atomic.write_file(tmp_path / "f", buffers)
    atomic.fsync_and_close(fd)
    assert (tmp_path / "f").read_bytes() == _expected(buffers)


@pytest.mark.parametrize("limit", [1, 7, 4096, 65537])
def test_short_writes_resume_inside_the_buffer_they_stopped_in(tmp_path, monkeypatch, limit):
    """The kernel may write less than asked (a signal, a full pipe, the 2 GiB cap): the rest follows in order."""
    real_writev, calls = os.writev, []

    def short_writev(fd, batch):  # the real call, told to write at most ``limit`` bytes
        kept, size = [], 0
        for view in batch:
            take = memoryview(view)[:max(0, limit - size)]
            if len(take):
                kept.append(take)
                size += len(take)
        calls.append(size)
        return real_writev(fd, kept)

    buffers = _buffers()[:300]
    monkeypatch.setattr(atomic.os, "writev", short_writev)
    atomic.fsync_and_close(atomic.write_file(tmp_path / "f", buffers))
    assert (tmp_path / "f").read_bytes() == _expected(buffers)
    assert max(calls) <= limit and len(calls) >= len(_expected(buffers)) // limit


def test_a_writev_that_writes_nothing_is_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic.os, "writev", lambda fd, batch: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        atomic.write_file(tmp_path / "f", [b"data"])

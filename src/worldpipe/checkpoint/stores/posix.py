"""POSIX store (:mod:`.base`): atomic via rename, durable via fsync. A step is written into a hidden
``.step-NNNNNN.partial-<nonce>/`` and renamed into place; ``latest`` and deletions go through a hidden name too.
A crash (SIGKILL, power loss) leaves at most a hidden directory, which readers never list and the next save
removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any, BinaryIO

import torch

from worldpipe.core import ownership
from worldpipe.core.atomic import (
    fsync_and_close,
    fsync_dir,
    makedirs_durably,
    publish_dir,
    remove_atomic,
    write_atomic,
    write_file,
    write_file_durably,
)

from .. import layout
from ..errors import CheckpointWriteError, PathEscapeError
from ..tensorfile import Segment
from ..thread_pool import shared_pool
from .base import StepWriter, Store


class PosixStore(Store):
    """Checkpoints in a local (or any POSIX, same-filesystem-rename) directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root

    # ---------------------------------------------------------------- reading

    def _path(self, step: int, relpath: str | None = None) -> str:
        base = os.path.join(self.root, layout.step_dir_name(step))
        return base if relpath is None else os.path.join(base, *relpath.split("/"))

    def local_path(self, step: int, relpath: str) -> str:
        """Path of a file of ``step`` for reading; raises PathEscapeError when it resolves outside the step.

        A manifest's paths are relative and normalized, but a symlink inside a step could still lead a reader
        anywhere: every read goes through here, so none follows one out of its step directory.
        """
        path = self._path(step, relpath)
        base = os.path.realpath(self._path(step))
        real = os.path.realpath(path)
        if not real.startswith(base + os.sep):
            raise PathEscapeError(f"resolves outside its step directory (to {real})")
        return path

    def step_names(self) -> list[int]:  # noqa: D102
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = {name: layout.parse_step_dir(name) for name in names}
        return [step for name, step in steps.items() if step is not None and os.path.isdir(os.path.join(self.root, name))]

    def step_exists(self, step: int) -> bool:  # noqa: D102
        return os.path.lexists(self._path(step))

    def open_file(self, step: int | None, relpath: str) -> BinaryIO:  # noqa: D102
        return open(os.path.join(self.root, relpath) if step is None else self.local_path(step, relpath), "rb",
                    buffering=0)

    def size_of(self, step: int, relpath: str) -> int | None:  # noqa: D102
        try:
            return os.stat(self.local_path(step, relpath)).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def load_torch(self, step: int, relpath: str, map_location: Any, mmap: bool = False) -> Any:  # noqa: D102
        return torch.load(self.local_path(step, relpath), map_location=map_location, weights_only=True, mmap=mmap)

    # ---------------------------------------------------------------- writing

    @contextlib.contextmanager
    def writer_lock(self, step: int) -> Iterator[None]:
        """Exclusive ``flock`` on ``.writer.lock``: two processes publishing into one root is a bug."""
        try:
            makedirs_durably(self.root)  # the new directories' names must survive a crash too
            fd = os.open(os.path.join(self.root, layout.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CheckpointWriteError(step, self.root, exc) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise CheckpointWriteError(step, os.path.join(self.root, layout.LOCK_NAME),
                                           "another process is publishing into this checkpoint directory") from exc
            yield
        finally:
            os.close(fd)  # releases the lock

    def step_writer(self, step: int, token: str | None = None) -> StepWriter:  # noqa: D102
        return _PartialDir(self, step, token or layout.temp_name(step, "partial", secrets.token_hex(6)))

    def write_latest(self, name: str) -> None:  # noqa: D102
        ownership.confirm(f"pointing {layout.LATEST_NAME} at {name}")
        write_atomic(os.path.join(self.root, layout.LATEST_NAME), f"{name}\n".encode())

    def remove_leftovers(self) -> list[str]:  # noqa: D102
        try:
            removed = [os.path.join(self.root, name) for name in os.listdir(self.root) if layout.is_leftover(name)]
        except FileNotFoundError:
            return []
        for path in removed:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if removed:
            fsync_dir(self.root)
        return removed

    def delete_step(self, step: int) -> None:  # noqa: D102
        ownership.confirm(f"deleting step {step}")
        # Renamed aside first: readers see the whole step or nothing, never a half-deleted one.
        remove_atomic(self._path(step), os.path.join(self.root, layout.temp_name(step, "deleting", secrets.token_hex(6))))



class _PartialDir(StepWriter):
    """A step written into a hidden partial directory of the store's root, renamed into place by the commit."""

    def __init__(self, store: PosixStore, step: int, token: str) -> None:
        self.store, self.step, self.token = store, step, token
        self.dir = os.path.join(store.root, token)

    def path(self, relpath: str = "") -> str:  # noqa: D102
        return os.path.join(self.dir, *relpath.split("/")) if relpath else self.dir

    def create(self) -> None:  # noqa: D102
        os.mkdir(self.dir, 0o755)

    def write(self, relpath: str, segments: list[Segment]) -> Future:  # noqa: D102
        path = self.path(relpath)
        if os.path.dirname(path) != self.dir:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # several ranks may make shards/ at once
        fd = write_file(path, segments)
        # fsync on another thread: this file's device I/O overlaps writing the next file.
        return shared_pool("ckpt-fsync", 2).submit(fsync_and_close, fd)

    def seal(self, relpaths: Iterable[str]) -> None:  # noqa: D102
        subdirs = {os.path.dirname(self.path(r)) for r in relpaths} - {self.dir}
        for sub in sorted(subdirs, key=len, reverse=True):  # deepest first; the partial dir after the manifest
            fsync_dir(sub)

    def stage_manifest(self, data: bytes) -> None:  # noqa: D102
        write_file_durably(self.path(layout.MANIFEST_NAME), [data])
        fsync_dir(self.dir)

    def commit(self) -> None:
        """The durable partial directory becomes ``step-NNNNNN`` (a re-saved step's old directory is moved aside
        under a hidden name first, and removed once the new one is durable)."""
        ownership.confirm(f"publishing step {self.step}")
        nonce = self.token.rsplit("-", 1)[-1]
        publish_dir(self.dir, self.store.location(self.step),
                    os.path.join(self.store.root, layout.temp_name(self.step, "replaced", nonce)))

    def discard(self) -> None:  # noqa: D102
        shutil.rmtree(self.dir, ignore_errors=True)

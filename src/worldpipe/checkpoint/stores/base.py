"""The interface a place that holds checkpoints offers (docs/architecture.md, "Publication protocol"), said once
here: a store says how each step of the protocol is done (:class:`StepWriter`), the order of the steps is
:mod:`worldpipe.checkpoint.publication`'s alone. Single writer: rank 0 commits (POSIX stores lock; object stores
cannot). Implementations: :mod:`.posix` (a directory) and :mod:`.object` (fsspec object stores).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any, BinaryIO, Protocol

from .. import layout
from ..tensorfile import Segment


class StepWriter(Protocol):
    """The files of one step on their way into a store, until the step is committed or discarded.

    :mod:`worldpipe.checkpoint.publication` calls these in the protocol's order; every process that writes
    files of the step holds a writer of the same :attr:`token`, the committing one also stages the manifest and
    commits. An I/O failure is an ``OSError`` (the protocol reports it as a CheckpointWriteError naming the file).
    """

    token: str  # names where the step is being written: another rank passes it to Store.step_writer

    def path(self, relpath: str = "") -> str:
        """Printable location of a file of the step being written (``""``: the step itself), for errors."""

    def create(self) -> None:
        """Make the place the files go (POSIX: the partial directory; object stores: clear an earlier attempt)."""

    def write(self, relpath: str, segments: list[Segment]) -> Future:
        """Write one file (it must not exist yet); the future is done once the file is durable."""

    def seal(self, relpaths: Iterable[str]) -> None:
        """Make the names of these files durable (POSIX: fsync the directories below the step that hold them)."""

    def stage_manifest(self, data: bytes) -> None:
        """Write ``MANIFEST.json``, after every file is durable (object stores: this PUT is the commit point)."""

    def commit(self) -> None:
        """Show the step to readers, durably (POSIX: rename into place, fsync the root)."""

    def discard(self) -> None:
        """Remove what was written of an uncommitted step (never raises: it runs while a failure propagates)."""


class Store(Protocol):
    """What the manager needs from a place that holds checkpoints."""

    url: str

    def step_names(self) -> list[int]:
        """Steps visible to readers (object stores: only committed ones), unsorted."""

    def step_exists(self, step: int) -> bool:
        """Whether anything exists under the step's directory name."""

    def location(self, step: int) -> str:
        """Printable location of a step directory."""
        return f"{self.url}/{layout.step_dir_name(step)}"

    def open_file(self, step: int | None, relpath: str) -> BinaryIO:
        """A file of ``step`` (None: of the store's root) opened for reading; FileNotFoundError when missing."""

    def read_manifest(self, step: int) -> bytes | None:
        """Raw MANIFEST.json of ``step``, or None when missing."""
        try:
            with self.open_file(step, layout.MANIFEST_NAME) as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size_of(self, step: int, relpath: str) -> int | None:
        """Size of a file of ``step``, None when missing."""

    def sha256_of(self, step: int, relpath: str) -> str:
        """SHA-256 of a file of ``step``, read from the store."""
        with self.open_file(step, relpath) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def load_torch(self, step: int, relpath: str, map_location: Any, mmap: bool = False) -> Any:
        """``torch.load(..., weights_only=True)`` of a file of ``step``; ``mmap``: memory-mapped where the store
        holds local files (a reader then touches only the bytes it uses), read whole elsewhere."""

    def read_latest(self) -> int | None:
        """Step named by the ``latest`` pointer, None when absent or unreadable."""
        try:
            with self.open_file(None, layout.LATEST_NAME) as f:
                return layout.parse_step_dir(f.read().decode().strip())
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def step_writer(self, step: int, token: str | None = None) -> StepWriter:
        """A writer of ``step``: a new place to write it (``token`` None: the committing process, before
        :meth:`StepWriter.create`), or the place another process's writer names by its ``token``."""

    def write_latest(self, name: str) -> None:
        """Point ``latest`` at the step directory ``name``, atomically and durably."""

    def remove_leftovers(self) -> list[str]:
        """Remove what crashed saves or deletions left behind; return what was removed."""

    def delete_step(self, step: int) -> None:
        """Remove a published step so that no reader sees a half-deleted one."""

    @contextlib.contextmanager
    def writer_lock(self, step: int) -> Iterator[None]:
        """Held while publishing; a no-op where the store cannot lock."""
        yield

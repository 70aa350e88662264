"""The interface a place that holds checkpoints offers the manager (docs/architecture.md, "Publication protocol").

Two implementations: :class:`worldpipe.checkpoint.stores.posix.PosixStore` (a directory: partial directory,
fsync, atomic rename) and :class:`worldpipe.checkpoint.stores.object.ObjectStore` (fsspec object stores:
files first, MANIFEST.json last as the commit marker). Single writer: rank 0 publishes; POSIX stores enforce it
with a lock file, object stores cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ..codec import PendingFile


class Store:
    """What the manager needs from a place that holds checkpoints."""

    url: str

    def step_names(self) -> list[int]:
        """Steps visible to readers (object stores: only committed ones), unsorted."""
        raise NotImplementedError

    def step_exists(self, step: int) -> bool:
        """Whether anything exists under the step's directory name."""
        raise NotImplementedError

    def location(self, step: int) -> str:
        """Printable location of a step directory."""
        raise NotImplementedError

    def read_manifest(self, step: int) -> bytes | None:
        """Raw MANIFEST.json of ``step``, or None when missing."""
        raise NotImplementedError

    def size_of(self, step: int, relpath: str) -> int | None:
        """Size of a file of ``step``, None when missing."""
        raise NotImplementedError

    def sha256_of(self, step: int, relpath: str) -> str:
        """SHA-256 of a file of ``step``, read from the store."""
        raise NotImplementedError

    def load_torch(self, step: int, relpath: str, map_location: Any) -> Any:
        """``torch.load(..., weights_only=True)`` of a file of ``step``."""
        raise NotImplementedError

    def read_json(self, step: int, relpath: str) -> Any:
        """Parsed JSON file of ``step``."""
        raise NotImplementedError

    def read_latest(self) -> int | None:
        """Step named by the ``latest`` pointer, None when absent or unreadable."""
        raise NotImplementedError

    def publish(self, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping,
                tensors: list[dict] | None = None) -> None:
        """Publish ``files`` as step ``step`` and point ``latest`` at it; raise CheckpointWriteError on failure."""
        raise NotImplementedError

    def remove_leftovers(self) -> list[str]:
        """Remove what crashed saves or deletions left behind; return what was removed."""
        raise NotImplementedError

    def delete_step(self, step: int) -> None:
        """Remove a published step so that no reader sees a half-deleted one."""
        raise NotImplementedError

    @contextlib.contextmanager
    def writer_lock(self, step: int) -> Iterator[None]:
        """Held while publishing; a no-op where the store cannot lock."""
        yield

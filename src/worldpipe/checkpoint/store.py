"""Checkpoint stores: the interface the manager uses, and the object-store implementation (fsspec).

Two protocols publish a step (docs/architecture.md, "Publication protocol"):

* POSIX directories (:class:`worldpipe.checkpoint.publish.PosixStore`): write into a hidden partial directory,
  fsync, atomically rename into place.
* Object stores without atomic rename (``memory://``, ``s3://``, ... via fsspec; :class:`ObjectStore`): write
  the files directly under ``step-NNNNNN/``, then ``MANIFEST.json`` LAST as the commit marker. Readers treat a
  step without a manifest as nonexistent. ``latest`` is written after the manifest.

Single writer: one process publishes to a store at a time (rank 0). POSIX stores enforce this with a lock file;
object stores cannot.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import torch

from . import fault, layout
from .codec import PendingFile
from .errors import CheckpointWriteError
from .manifest import FileRecord, build_manifest, hash_pool, sha256_segments, sha256_stream

logger = logging.getLogger("worldpipe.checkpoint")


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

    def publish(self, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping) -> None:
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


def open_store(root: str | Any, storage_options: Mapping | None = None) -> Store:
    """POSIX store for local paths (and ``file://``), object store for any other fsspec URL."""
    from .publish import PosixStore  # local import: publish depends on this module

    text = str(root)
    if "://" not in text:
        return PosixStore(text)
    if text.startswith("file://"):
        return PosixStore(text[len("file://"):])
    return ObjectStore(text, storage_options)


class ObjectStore(Store):
    """Object-store protocol over fsspec: files first, MANIFEST.json last as the commit marker."""

    def __init__(self, url: str, storage_options: Mapping | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **dict(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _step_path(self, step: int, relpath: str | None = None) -> str:
        base = posixpath.join(self.root, layout.step_dir_name(step))
        return base if relpath is None else posixpath.join(base, relpath)

    def _listed_steps(self) -> list[int]:
        # Listings are cached by some filesystems (s3fs); a reader must see the store as it is now.
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            step = layout.parse_step_dir(posixpath.basename(entry["name"].rstrip("/")))
            if step is not None and entry.get("type") == "directory":
                steps.append(step)
        return steps

    def step_names(self) -> list[int]:  # noqa: D102
        return [s for s in self._listed_steps() if self.fs.exists(self._step_path(s, layout.MANIFEST_NAME))]

    def step_exists(self, step: int) -> bool:  # noqa: D102
        return step in self._listed_steps()

    def location(self, step: int) -> str:  # noqa: D102
        return f"{self.url}/{layout.step_dir_name(step)}"

    def read_manifest(self, step: int) -> bytes | None:  # noqa: D102
        try:
            return self.fs.cat_file(self._step_path(step, layout.MANIFEST_NAME))
        except FileNotFoundError:
            return None

    def size_of(self, step: int, relpath: str) -> int | None:  # noqa: D102
        try:
            return int(self.fs.info(self._step_path(step, relpath))["size"])
        except FileNotFoundError:
            return None

    def sha256_of(self, step: int, relpath: str) -> str:  # noqa: D102
        with self.fs.open(self._step_path(step, relpath), "rb") as f:
            return sha256_stream(f)

    def load_torch(self, step: int, relpath: str, map_location: Any) -> Any:  # noqa: D102
        data = self.fs.cat_file(self._step_path(step, relpath))
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)

    def read_json(self, step: int, relpath: str) -> Any:  # noqa: D102
        return json.loads(self.fs.cat_file(self._step_path(step, relpath)))

    def read_latest(self) -> int | None:  # noqa: D102
        try:
            text = self.fs.cat_file(posixpath.join(self.root, layout.LATEST_NAME)).decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return layout.parse_step_dir(text)

    def _remove_step(self, step: int) -> None:
        # Manifest first: the step stops being visible before any of its files disappear.
        manifest = self._step_path(step, layout.MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        base = self._step_path(step)
        if self.fs.exists(base):
            self.fs.rm(base, recursive=True)
        self.fs.invalidate_cache()

    def publish(self, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping) -> None:  # noqa: D102
        current = self._step_path(step)
        try:
            fault.inject("before_files")
            if self.step_exists(step):
                # A crashed earlier attempt (or a step being re-saved): never mix old and new files.
                self._remove_step(step)
            records = []
            for index, pending in enumerate(files):
                current = self._step_path(step, pending.relpath)
                digest = hash_pool().submit(sha256_segments, pending.segments)
                with self.fs.open(current, "wb") as f:
                    for seg in pending.segments:
                        f.write(seg)
                records.append(FileRecord(pending.relpath, pending.size, digest.result()))
                if index == 0:
                    fault.inject("mid_files")
            fault.inject("after_files")
            current = self._step_path(step, layout.MANIFEST_NAME)
            # The commit point: a single PUT of the manifest.
            self.fs.pipe_file(current, build_manifest(step, records, contents, identity))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._remove_step(step)
            raise CheckpointWriteError(step, current, exc) from exc
        current = posixpath.join(self.root, layout.LATEST_NAME)
        try:
            fault.inject("after_manifest")
            fault.inject("after_rename")  # no rename in object stores: same point as after_manifest
            self.fs.pipe_file(current, f"{layout.step_dir_name(step)}\n".encode())
            self.fs.invalidate_cache()
            fault.inject("after_latest")
        except Exception as exc:
            raise CheckpointWriteError(step, current, exc) from exc

    def remove_leftovers(self) -> list[str]:  # noqa: D102
        removed = []
        for step in self._listed_steps():
            if not self.fs.exists(self._step_path(step, layout.MANIFEST_NAME)):
                self._remove_step(step)
                removed.append(self.location(step))
        return removed

    def delete_step(self, step: int) -> None:  # noqa: D102
        self._remove_step(step)

"""Object stores over fsspec (``memory://``, ``s3://``, ...; :mod:`.base`), without an atomic rename: readers
treat a step without a manifest as nonexistent.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import posixpath
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, BinaryIO

import fsspec
import torch

from worldpipe.core import ownership

from .. import layout
from ..tensorfile import Segment
from .base import StepWriter, Store

logger = logging.getLogger("worldpipe.checkpoint")


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
        steps = [(layout.parse_step_dir(posixpath.basename(e["name"].rstrip("/"))), e.get("type")) for e in entries]
        return [step for step, kind in steps if step is not None and kind == "directory"]

    def step_names(self) -> list[int]:  # noqa: D102
        return [s for s in self._listed_steps() if self.fs.exists(self._step_path(s, layout.MANIFEST_NAME))]

    def step_exists(self, step: int) -> bool:  # noqa: D102
        return step in self._listed_steps()

    def open_file(self, step: int | None, relpath: str) -> BinaryIO:  # noqa: D102
        # Read whole with one GET: an fsspec file's size may come from a stale listing cache.
        return io.BytesIO(self.fs.cat_file(self._step_path(step, relpath) if step is not None else
                                           posixpath.join(self.root, relpath)))

    def size_of(self, step: int, relpath: str) -> int | None:  # noqa: D102
        try:
            return int(self.fs.info(self._step_path(step, relpath))["size"])
        except FileNotFoundError:
            return None

    def sha256_of(self, step: int, relpath: str) -> str:  # noqa: D102
        with self.fs.open(self._step_path(step, relpath), "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def load_torch(self, step: int, relpath: str, map_location: Any, mmap: bool = False) -> Any:  # noqa: D102
        return torch.load(self.open_file(step, relpath), map_location=map_location, weights_only=True)

    def _remove_step(self, step: int) -> None:
        # Manifest first: the step stops being visible before any of its files disappear.
        manifest = self._step_path(step, layout.MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        base = self._step_path(step)
        if self.fs.exists(base):
            self.fs.rm(base, recursive=True)
        self.fs.invalidate_cache()

    def remove_leftovers(self) -> list[str]:  # noqa: D102
        removed = []
        for step in self._listed_steps():
            if not self.fs.exists(self._step_path(step, layout.MANIFEST_NAME)):
                self._remove_step(step)
                removed.append(self.location(step))
        return removed

    def step_writer(self, step: int, token: str | None = None) -> StepWriter:  # noqa: D102
        return _StepObjects(self, step)

    def write_latest(self, name: str) -> None:  # noqa: D102 - a single PUT
        ownership.confirm(f"pointing {layout.LATEST_NAME} at {name}")
        with _io_errors():
            self.fs.pipe_file(posixpath.join(self.root, layout.LATEST_NAME), f"{name}\n".encode())
        self.fs.invalidate_cache()

    def delete_step(self, step: int) -> None:  # noqa: D102
        ownership.confirm(f"deleting step {step}")
        self._remove_step(step)


class _StepObjects(StepWriter):
    """A step written straight to its objects; the manifest, written last, commits it."""

    token = ""  # every writer of a step writes under the step's own name

    def __init__(self, store: ObjectStore, step: int) -> None:
        self.store, self.step = store, step

    def path(self, relpath: str = "") -> str:  # noqa: D102
        return self.store._step_path(self.step, relpath or None)

    def create(self) -> None:  # noqa: D102
        with _io_errors():
            if self.store.step_exists(self.step):
                # A crashed earlier attempt (or a step being re-saved): never mix old and new files.
                self.store.delete_step(self.step)

    def write(self, relpath: str, segments: list[Segment]) -> Future:  # noqa: D102
        with _io_errors(), self.store.fs.open(self.path(relpath), "wb") as f:
            for seg in segments:
                f.write(seg)
        done: Future = Future()
        done.set_result(None)  # the object exists once its upload is closed
        return done

    def stage_manifest(self, data: bytes) -> None:  # noqa: D102 - the commit point: a single PUT
        ownership.confirm(f"publishing step {self.step}")
        with _io_errors():
            self.store.fs.pipe_file(self.path(layout.MANIFEST_NAME), data)

    def discard(self) -> None:  # noqa: D102
        with contextlib.suppress(Exception):
            self.store._remove_step(self.step)


@contextlib.contextmanager
def _io_errors() -> Iterator[None]:
    """A backend's own error (fsspec filesystems raise their clients' exceptions too) as the OSError it is."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from exc

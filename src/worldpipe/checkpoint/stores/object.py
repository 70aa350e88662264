"""Object-store protocol over fsspec (``memory://``, ``s3://``, ...): no atomic rename, so the files of a step
are written first and ``MANIFEST.json`` LAST, as the commit marker; readers treat a step without a manifest as
nonexistent, and ``latest`` is written after the manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec
import torch

from worldpipe.core import ownership

from .. import fault, layout
from ..codec import PendingFile
from ..errors import CheckpointWriteError
from ..manifest import FileRecord, build_manifest, hash_pool, sha256_segments, sha256_stream
from .base import Store

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

    def publish(self, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping,
                tensors: list[dict] | None = None) -> None:  # noqa: D102
        current = self._step_path(step)
        try:
            fault.inject("before_files")
            if self.step_exists(step):
                # A crashed earlier attempt (or a step being re-saved): never mix old and new files.
                self.delete_step(step)
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
            self.commit_manifest(step, build_manifest(step, records, contents, identity, tensors))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._remove_step(step)
            raise CheckpointWriteError(step, current, exc) from exc
        current = posixpath.join(self.root, layout.LATEST_NAME)
        try:
            fault.inject("after_manifest")
            fault.inject("after_rename")  # no rename in object stores: same point as after_manifest
            self.write_latest(layout.step_dir_name(step))
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

    def commit_manifest(self, step: int, manifest: bytes) -> None:
        """The commit point of a step: a single PUT of its manifest (every file is written before)."""
        ownership.confirm(f"publishing step {step}")
        self.fs.pipe_file(self._step_path(step, layout.MANIFEST_NAME), manifest)

    def write_latest(self, name: str) -> None:
        """Point ``latest`` at ``name`` (a single PUT)."""
        ownership.confirm(f"pointing {layout.LATEST_NAME} at {name}")
        self.fs.pipe_file(posixpath.join(self.root, layout.LATEST_NAME), f"{name}\n".encode())
        self.fs.invalidate_cache()

    def delete_step(self, step: int) -> None:  # noqa: D102
        ownership.confirm(f"deleting step {step}")
        self._remove_step(step)

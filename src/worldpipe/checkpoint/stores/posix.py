"""POSIX store: the publication protocol for a local directory (docs/architecture.md, "Publication protocol"): atomic via rename, durable via fsync, in this order.

1. write every file into ``.step-NNNNNN.partial-<nonce>/``: write, ``fsync(file)``; fsync its subdirectories;
2. write ``MANIFEST.json`` (every file, size, sha256; step; identity), ``fsync`` it, ``fsync`` the partial dir;
3. ``rename`` the partial dir to ``step-NNNNNN`` and ``fsync`` the checkpoints dir: only now is it durable;
4. replace ``latest``: temp file, ``fsync``, ``rename``, ``fsync`` the checkpoints dir;
5. retention (done by the manager) deletes old steps only after that: rename to a hidden name, fsync, remove.

A failure before step 3 removes the partial dir and raises CheckpointWriteError naming the step and the file;
the previous checkpoint and ``latest`` are untouched. A crash (SIGKILL, power loss) leaves at most a hidden
partial dir, which readers never list and the next save removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from worldpipe.core import ownership
from worldpipe.core.atomic import (
    fsync_and_close,
    fsync_dir,
    publish_dir,
    remove_atomic,
    write_file,
    write_file_durably,
)

from .. import fault, layout
from ..codec import PendingFile
from ..errors import CheckpointWriteError, PathEscapeError
from ..files import fsync_pool
from ..manifest import FileRecord, build_manifest, hash_pool, sha256_segments, sha256_stream
from .base import Store


class _Cursor:
    """The path the publication is working on, so an error can name it."""

    def __init__(self, path: str) -> None:
        self.path = path


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
        steps = []
        for name in names:
            step = layout.parse_step_dir(name)
            if step is not None and os.path.isdir(os.path.join(self.root, name)):
                steps.append(step)
        return steps

    def step_exists(self, step: int) -> bool:  # noqa: D102
        return os.path.lexists(self._path(step))

    def location(self, step: int) -> str:  # noqa: D102
        return self._path(step)

    def read_manifest(self, step: int) -> bytes | None:  # noqa: D102
        try:
            with open(self.local_path(step, layout.MANIFEST_NAME), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size_of(self, step: int, relpath: str) -> int | None:  # noqa: D102
        try:
            st = os.stat(self.local_path(step, relpath))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size

    def sha256_of(self, step: int, relpath: str) -> str:  # noqa: D102
        with open(self.local_path(step, relpath), "rb", buffering=0) as f:
            return sha256_stream(f)

    def load_torch(self, step: int, relpath: str, map_location: Any) -> Any:  # noqa: D102
        return torch.load(self.local_path(step, relpath), map_location=map_location, weights_only=True)

    def read_json(self, step: int, relpath: str) -> Any:  # noqa: D102
        with open(self.local_path(step, relpath), "rb") as f:
            return json.load(f)

    def read_latest(self) -> int | None:  # noqa: D102
        try:
            with open(os.path.join(self.root, layout.LATEST_NAME), "rb") as f:
                return layout.parse_step_dir(f.read().decode().strip())
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    # ---------------------------------------------------------------- writing

    def _ensure_root(self) -> None:
        missing = []
        path = self.root
        while not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            # The new directory's name must survive a crash too.
            fsync_dir(os.path.dirname(path))

    @contextlib.contextmanager
    def writer_lock(self, step: int) -> Iterator[None]:
        """Exclusive ``flock`` on ``.writer.lock``: two processes publishing into one root is a bug."""
        try:
            self._ensure_root()
            fd = os.open(os.path.join(self.root, layout.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CheckpointWriteError(step, self.root, exc) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise CheckpointWriteError(
                    step, os.path.join(self.root, layout.LOCK_NAME),
                    "another process is publishing into this checkpoint directory") from exc
            yield
        finally:
            os.close(fd)  # releases the lock

    def publish(self, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping,
                tensors: list[dict] | None = None) -> None:  # noqa: D102
        name = layout.step_dir_name(step)
        nonce = secrets.token_hex(6)
        partial = os.path.join(self.root, layout.temp_name(step, "partial", nonce))
        final = os.path.join(self.root, name)
        cursor = _Cursor(partial)
        created = False
        try:
            self._ensure_root()
            fault.inject("before_files")
            os.mkdir(partial, 0o755)
            created = True
            self._write_files(partial, files, step, contents, identity, cursor, tensors)
            fault.inject("after_manifest")
            cursor.path = final
            self.rename_into_place(partial, final, step, nonce)
        except BaseException as exc:
            if created:
                shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, OSError):
                raise CheckpointWriteError(step, cursor.path, exc) from exc
            raise
        cursor.path = os.path.join(self.root, layout.LATEST_NAME)
        try:
            fault.inject("after_rename")
            self.write_latest(name)
            fault.inject("after_latest")
        except OSError as exc:
            raise CheckpointWriteError(step, cursor.path, exc) from exc

    def _write_files(self, partial: str, files: list[PendingFile], step: int, contents: Mapping,
                     identity: Mapping, cursor: _Cursor, tensors: list[dict] | None) -> None:
        subdirs: list[str] = []
        records: list[FileRecord] = []
        digests = []
        syncs: list[tuple[str, Future]] = []
        # Hash the same bytes on other threads while this one writes them (hashlib drops the GIL). Largest
        # first: the longest hash starts at once instead of becoming a serial tail after the writes.
        for pending in sorted(files, key=lambda f: f.size, reverse=True):
            digests.append((pending, hash_pool().submit(sha256_segments, pending.segments)))
        try:
            self._write_all_files(partial, files, cursor, subdirs, syncs)
        finally:
            # Every descriptor gets closed, and the first fsync failure is reported with its file.
            first_error = None
            for path, done in syncs:
                try:
                    done.result()
                except OSError as exc:
                    if first_error is None:
                        first_error, cursor.path = exc, path
            if first_error is not None:
                raise first_error
        for pending, digest in digests:
            records.append(FileRecord(pending.relpath, pending.size, digest.result()))
        for sub in sorted(subdirs, key=len, reverse=True):
            cursor.path = sub
            fsync_dir(sub)
        cursor.path = partial
        fault.inject("after_files")
        cursor.path = os.path.join(partial, layout.MANIFEST_NAME)
        write_file_durably(cursor.path, [build_manifest(step, records, contents, identity, tensors)])
        cursor.path = partial
        fsync_dir(partial)

    def _write_all_files(self, partial: str, files: list[PendingFile], cursor: _Cursor, subdirs: list[str],
                         syncs: list) -> None:
        for index, pending in enumerate(files):
            path = os.path.join(partial, *pending.relpath.split("/"))
            parent = os.path.dirname(path)
            if parent != partial and parent not in subdirs:
                cursor.path = parent
                os.makedirs(parent, exist_ok=True)
                subdirs.append(parent)
            cursor.path = path
            fd = write_file(path, pending.segments)
            # fsync on another thread: this file's device I/O overlaps writing the next file.
            syncs.append((path, fsync_pool().submit(fsync_and_close, fd)))
            if index == 0:
                fault.inject("mid_files")

    def rename_into_place(self, partial: str, final: str, step: int, nonce: str) -> None:
        """Step 3 of the protocol: the durable partial directory becomes ``step-NNNNNN`` (a re-saved step's old
        directory is moved aside under a hidden name first, and removed once the new one is durable)."""
        ownership.confirm(f"publishing step {step}")
        publish_dir(partial, final, os.path.join(self.root, layout.temp_name(step, "replaced", nonce)))

    def write_latest(self, name: str) -> None:
        """Atomically and durably point ``latest`` at ``name``: temp file, fsync, rename, fsync dir."""
        tmp = os.path.join(self.root, layout.latest_temp_name(secrets.token_hex(6)))
        try:
            write_file_durably(tmp, [f"{name}\n".encode()])
            ownership.confirm(f"pointing {layout.LATEST_NAME} at {name}")
            os.replace(tmp, os.path.join(self.root, layout.LATEST_NAME))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(self.root)

    def remove_leftovers(self) -> list[str]:  # noqa: D102
        removed = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return removed
        for name in names:
            if not layout.is_leftover(name):
                continue
            path = os.path.join(self.root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        if removed:
            fsync_dir(self.root)
        return removed

    def delete_step(self, step: int) -> None:  # noqa: D102
        ownership.confirm(f"deleting step {step}")
        # Renamed aside first: readers see the whole step or nothing, never a half-deleted one.
        remove_atomic(self._path(step), os.path.join(self.root, layout.temp_name(step, "deleting", secrets.token_hex(6))))


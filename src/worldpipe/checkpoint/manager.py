"""CheckpointManager: save (sync or async), list, verify and load the checkpoints under one root."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from worldpipe.core.locations import local_path

from . import fault, layout
from .async_writer import AsyncWriter
from .codec import PendingFile, decode_state, encode_state, files_for_keys
from .digest import state_digest
from .errors import CheckpointCorruptError, CheckpointNotFoundError
from .loadable import found_tensors, newest_loadable, step_problems, structure_problems, tensor_table
from .manifest import check_sizes, collect_hashes, parse_manifest, start_hashes
from .publication import publish
from .resharding import StepFiles, lazy_state
from .state import validate_state
from .stores.base import Store
from .stores.object import ObjectStore
from .stores.posix import PosixStore
from .tensorfile import UnsupportedObject

logger = logging.getLogger("worldpipe.checkpoint")

VERIFY_MODES = ("size", "sha256", "first")

# (store url, step, manifest checksum) of steps whose every file matched its sha256 in this process.
_fully_verified: set[tuple[str, int, str]] = set()
_verified_lock = threading.Lock()


@dataclass(frozen=True)
class CheckpointInfo:
    """One published step as seen by :meth:`CheckpointManager.list`."""
    step: int
    path: str
    size_bytes: int
    intact: bool
    problem: str | None
    is_latest: bool


class CheckpointManager(contextlib.AbstractContextManager):
    """Publishes, verifies and loads the checkpoints of one run (single writer: rank 0).

    ``root`` is a local directory (POSIX protocol: partial dir + fsync + atomic rename) or an fsspec URL such as
    ``s3://bucket/run/checkpoints`` or ``memory://x`` (object-store protocol: manifest last as commit marker;
    ``storage_options`` go to fsspec). ``keep_last`` (>= 2) intact checkpoints are kept, plus every step that
    is a multiple of ``keep_every``. ``verify`` selects how loads check files against the manifest: ``"size"``,
    ``"sha256"``, or ``"first"`` (sha256 the first time a step is loaded/selected in this process, sizes after).
    With ``async_save`` a save copies the state (the only stall) and publishes on a background thread, at the
    lowest CPU priority unless ``background_priority`` is False (a benchmark's before).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, keep_every: int | None = None,
                 async_save: bool = False, verify: str = "first", storage_options: Mapping | None = None,
                 background_priority: bool = True) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 2:
            # One checkpoint is no fallback: a corrupt newest one would leave nothing to resume from.
            raise ValueError(f"keep_last must be an int >= 2, got {keep_last!r}")
        if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int)
                                       or keep_every < 1):
            raise ValueError(f"keep_every must be a positive int or None, got {keep_every!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        # POSIX store for local paths (and ``file://``), object store for any other fsspec URL.
        path = local_path(os.fspath(root))
        self.store: Store = PosixStore(path) if path is not None else ObjectStore(os.fspath(root), storage_options)
        self.root = self.store.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.verify_mode = verify
        self.writer = AsyncWriter(background_priority)
        self._closed = False
        self._preloaded: tuple[int, dict] | None = None  # chosen by latest_loadable(), handed to load()

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Mapping, optimizer: torch.optim.Optimizer | None = None,
             wait: bool = False) -> None:
        """Publish ``state`` as checkpoint ``step`` (through :attr:`writer`, :mod:`.async_writer`).

        Sync: returns once the checkpoint is durable and ``latest`` names it. Async: returns after copying the
        state; publication runs in the background, one at a time and in order (this call first waits for the
        previous one). A failure of the previous background save is raised here (and this save not started).
        Async with ``optimizer``: what ``optimizer.step()`` writes is copied in the background, overlapping the next
        forward and backward (:meth:`.AsyncWriter.snapshot`).
        ``wait``: publish on this thread as a sync save does, async or not (a final save that is waited for
        anyway must not wait for a background-priority writer that the machine's other work starves).
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        layout.step_dir_name(step)
        validate_state(state)
        self.writer.wait()
        if not self.async_save or wait:
            self.writer.run(step, lambda: self._publish(step, self._prepare(state)))
            return
        snapshot = self.writer.snapshot(state, optimizer)
        try:  # here, not on the writer: its Python work would hold the GIL at background priority
            prepared = self._prepare(snapshot, fallback=False)
        except UnsupportedObject:  # torch.save's fallback reads the bytes: only once the copy is complete
            prepared = None
        self.writer.submit(step, lambda: self._publish(step, prepared or self._prepare(snapshot)))

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is published; raise its failure."""
        self.writer.wait()

    def close(self) -> None:
        """Wait for the in-flight save (raising its failure) and release the background thread."""
        if not self._closed:
            self._closed = True
            self.writer.close()

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _prepare(state: Mapping, fallback: bool = True) -> tuple[list[PendingFile], dict, Mapping, list[dict]]:
        """:func:`.publication.publish`'s files, contents, identity and tensor table of ``state`` (tensor bytes
        referenced, not yet read)."""
        files, contents = encode_state(state, fallback)
        return files, contents, state.get(layout.IDENTITY) or {}, tensor_table(state)

    def _publish(self, step: int, prepared: tuple) -> None:
        with self.store.writer_lock(step), fault.publishing(step):
            publish(self.store, step, *prepared)
            self.retain_after(step)

    def retain_after(self, step: int) -> None:
        """Delete what the retention policy no longer keeps once ``step`` is published (under its writer lock).

        A failure is logged, not raised: the new checkpoint is durable, and retention is recomputed next save.
        """
        try:
            fault.inject("before_retention")
            for old in select_deletions(self.store.step_names(), step, self.keep_last, self.keep_every,
                                        lambda s: not self.verify(s, full=False)):
                logger.info("retention: deleting %s", self.store.location(old))
                self.store.delete_step(old)
            fault.inject("after_retention")
        except OSError as exc:
            logger.error("retention after saving step %d failed: %s", step, exc)

    # ----------------------------------------------------------------- reading

    def _manifest(self, step: int) -> tuple[dict | None, list[str]]:
        name = layout.step_dir_name(step)
        try:
            raw = self.store.read_manifest(step)
        except OSError as exc:
            return None, [f"{name}/{layout.MANIFEST_NAME}: unreadable ({exc})"]
        if raw is None:
            if not self.store.step_exists(step):
                return None, [f"{name}: no such checkpoint in {self.root}"]
            return None, [f"{name}/{layout.MANIFEST_NAME}: missing (partial or uncommitted step)"]
        return parse_manifest(raw, step)

    def verify(self, step: int, full: bool | None = True) -> list[str]:
        """Problems of checkpoint ``step`` (``[]`` when intact), each naming the file.

        ``full`` compares every file's SHA-256 with the manifest, otherwise only presence and sizes (None: as the
        ``verify`` mode says).
        """
        manifest, problems = self._manifest(step)
        if manifest is not None:  # else problems say why
            problems = check_sizes(manifest, step, lambda p: self.store.size_of(step, p))
        if not problems and (self._full_by_policy(step, manifest) if full is None else full):
            problems = collect_hashes(step, start_hashes(manifest, lambda p: self.store.sha256_of(step, p)))
            if not problems:
                self._mark_verified(step, manifest)
        return problems

    def _full_by_policy(self, step: int, manifest: Mapping) -> bool:
        if self.verify_mode != "first":
            return self.verify_mode == "sha256"
        with _verified_lock:
            return (self.root, step, manifest["manifest_sha256"]) not in _fully_verified

    def _mark_verified(self, step: int, manifest: Mapping) -> None:
        with _verified_lock:
            _fully_verified.add((self.root, step, manifest["manifest_sha256"]))

    def list(self) -> list[CheckpointInfo]:
        """The steps readers see (:meth:`.Store.step_names`), oldest first, size-verified (sha256: :meth:`verify`)."""
        latest = self.store.read_latest()
        infos = []
        for step in sorted(self.store.step_names()):
            manifest, _ = self._manifest(step)
            size = sum(f["size"] for f in manifest["files"]) if manifest else 0
            problems = self.verify(step, full=False)
            infos.append(CheckpointInfo(step, self.store.location(step), size, not problems,
                                        problems[0] if problems else None, step == latest))
        return infos

    def latest_intact(self) -> int | None:
        """Newest step whose manifest and files verify (per ``verify`` mode); warns about each one skipped."""
        for step in sorted(self.store.step_names(), reverse=True):
            problems = self.verify(step, full=None)
            if not problems:
                latest = self.store.read_latest()
                if latest is not None and latest != step:
                    logger.info("`latest` names step %d; newest intact checkpoint is step %d", latest, step)
                return step
            logger.warning("skipping checkpoint %s: %s", self.store.location(step), "; ".join(problems))
        return None

    def latest_loadable(self, expected: Mapping[str, Any] | None = None, keep: bool = True) -> int | None:
        """Newest loadable step (see :mod:`.loadable`); each step skipped is reported by name with its problem.

        ``expected``: ``{name: shape}`` of the model the state will be loaded into. With ``keep`` the decoded
        state of an unsharded step is kept for the next ``load(step)`` of it (on CPU, all keys), so choosing
        costs no second read.
        """
        step, state = newest_loadable(self, expected)
        self._preloaded = (step, state) if state is not None and keep else None
        return step

    def load(self, step: int | None = None, map_location: Any = "cpu", keys: Iterable[str] | None = None) -> dict:
        """Load checkpoint ``step`` (default: the newest loadable one) as a state dict like the one saved.

        Absent optional parts (scheduler, scaler, EMA) are None. ``keys`` loads only these state keys (others
        None). Files are verified per the ``verify`` mode while they load (hashing overlaps reading); without
        ``step``, a step that fails is reported by name and the next older one tried; a requested ``step``
        that fails raises CheckpointCorruptError naming the file(s). RNG states always load on CPU.
        """
        wanted = None if keys is None else set(keys)
        preloaded, self._preloaded = self._preloaded, None
        if preloaded is not None and preloaded[0] == step and wanted is None and map_location == "cpu":
            return preloaded[1]
        if wanted is not None and wanted - set(layout.STATE_KEYS):
            raise ValueError(f"unknown state keys {sorted(wanted - set(layout.STATE_KEYS))}")
        if step is None:
            step = self.latest_loadable()
            if step is None:
                raise CheckpointNotFoundError(f"no loadable checkpoint in {self.root}")
            return self.load(step, map_location, keys)
        state, problems = self._load_verified(step, map_location, wanted)
        if state is None:
            if not self.store.step_exists(step):
                raise CheckpointNotFoundError(problems[0])
            raise CheckpointCorruptError(step, problems)
        return state

    def _load_verified(self, step: int, map_location: Any, wanted: set[str] | None) -> tuple[dict | None, list[str]]:
        manifest, problems = self._manifest(step)
        if manifest is None:
            return None, problems
        only = files_for_keys(manifest["contents"], wanted)
        problems = check_sizes(manifest, step, lambda p: self.store.size_of(step, p), only)
        if problems:
            return None, problems
        full = self._full_by_policy(step, manifest)
        # Hash on the hash threads while this thread deserializes: a weights_only load of a damaged file is
        # harmless (it never runs code), and its result is discarded unless every digest matches.
        pending = start_hashes(manifest, lambda p: self.store.sha256_of(step, p), only) if full else []
        source = StepFiles(self, step, manifest, map_location, mmap=False)
        state = None
        try:
            state = decode_state(manifest["contents"], source.load, source.read_json, wanted)
        except CheckpointCorruptError as exc:
            problems = exc.problems
        if state is not None:  # hash-valid files holding other shapes than the writer recorded do not load
            keys = set(layout.TENSOR_KEYS) if wanted is None else wanted & set(layout.TENSOR_KEYS)
            problems = structure_problems(found_tensors(state, sorted(keys)), manifest, step, keys)
        # Always wait for the hashes (no work left behind); a digest mismatch is the more precise report.
        hash_problems = collect_hashes(step, pending)
        if hash_problems or problems:
            return None, hash_problems or problems
        if full and only is None:
            self._mark_verified(step, manifest)
        return state, []


def select_deletions(steps: Iterable[int], current: int, keep_last: int, keep_every: int | None,
                     is_intact: Callable[[int], bool]) -> list[int]:
    """Steps to delete after ``current`` was published.

    Kept: ``current``; the ``keep_last - 1`` newest older steps that are intact (so ``keep_last`` intact
    checkpoints remain to fall back on); older steps that are multiples of ``keep_every``; and every step newer
    than ``current`` (those belong to a run that was resumed from an earlier step; deleting them is not
    retention's call). Everything else older than ``current`` is deleted, oldest first.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    older = sorted((s for s in set(steps) if s < current), reverse=True)
    keep: set[int] = set()
    remaining = keep_last - 1
    for step in older:
        if remaining <= 0:
            break
        if is_intact(step):
            keep.add(step)
            remaining -= 1
    if keep_every:
        keep.update(s for s in older if s % keep_every == 0)
    return sorted(s for s in older if s not in keep)


def require_step(manager: CheckpointManager, step: int) -> None:
    """Raise :class:`CheckpointNotFoundError` (exit 2, naming the steps there are) unless ``step`` is stored."""
    if not manager.store.step_exists(step):
        raise CheckpointNotFoundError(f"no checkpoint step {step} in {manager.root} (steps: "
                                      f"{', '.join(map(str, sorted(manager.store.step_names()))) or 'none'})")


def checkpoint_digest(root: str | os.PathLike, step: int | None = None,
                      storage_options: Mapping | None = None) -> str:
    """:func:`state_digest` of a stored checkpoint (default: the newest loadable one, as training would resume).

    A sharded checkpoint is digested tensor by tensor from its memory-mapped shards, never whole.
    """
    manager = CheckpointManager(root, storage_options=storage_options)
    if step is None:
        step, state = newest_loadable(manager)
        if step is None:
            raise CheckpointNotFoundError(f"no loadable checkpoint in {manager.root}")
    else:
        require_step(manager, step)
        problems, state = step_problems(manager, step)
        if problems:
            raise CheckpointCorruptError(step, problems)
    # An unsharded step was decoded while it was checked; a sharded one is digested from its shards (just verified).
    return state_digest(state if state is not None else lazy_state(manager, step))


__all__ = ["CheckpointInfo", "CheckpointManager", "checkpoint_digest", "require_step", "state_digest"]

"""Publishing a sharded checkpoint: every rank writes its own pieces, rank 0 commits (collective).

The publication protocol of :mod:`.publish`, with step 1 done by every rank:

1. rank 0 takes the writer lock, removes leftovers, creates ``.step-NNNNNN.partial-<nonce>/shards/`` and
   broadcasts the partial directory's name (object stores: the step directory, cleared of any earlier attempt);
2. every rank writes ``shards/rank-NNNNN.pt`` (its local pieces; write, ``fsync``) and hashes it meanwhile;
3. rank 0 gathers every rank's file record (path, size, sha256) and pieces, writes its own files (the
   skeleton: every non-sharded part, see :mod:`.shards`) and ``shards/index.json``, fsyncs ``shards/``, writes
   ``MANIFEST.json`` last, fsyncs the partial dir, renames it into place, fsyncs the root, replaces ``latest``;
4. rank 0 broadcasts the outcome: every rank returns, or every rank raises CheckpointWriteError.

A rank killed anywhere before the rename leaves only a hidden partial directory (or, on object stores, a
step without a manifest), which readers never see and the next save removes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from worldpipe.core.atomic import fsync_and_close, fsync_dir, write_all, write_file_durably

from . import fault, layout, shards
from .codec import PendingFile, encode_state, json_bytes
from .errors import CheckpointWriteError
from .manifest import FileRecord, build_manifest, hash_pool, sha256_segments
from .stores import ObjectStore, PosixStore, Store
from .structure import tensor_table
from .tensorfile import encode_with_fallback

logger = logging.getLogger("worldpipe.checkpoint")


class Collective:
    """The few collectives a sharded save needs, over ``group`` (a single process when not distributed)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (index = rank) on rank 0, None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                           group=self.group)
        return out


class _PosixStep:
    """Files of one step being written into a partial directory shared by all ranks."""

    def __init__(self, store: PosixStore, step: int, partial: str) -> None:
        self.store, self.step, self.partial = store, step, partial

    def begin(self) -> None:
        """Rank 0: create the partial directory (and ``shards/``) and make their names durable."""
        os.mkdir(self.partial, 0o755)
        os.mkdir(os.path.join(self.partial, shards.SHARD_DIR), 0o755)
        fsync_dir(self.partial)

    def path(self, relpath: str) -> str:
        """Absolute path of a file of the step."""
        return os.path.join(self.partial, *relpath.split("/"))

    def write(self, relpath: str, segments: list, midway_fault: bool = False) -> FileRecord:
        """Write one file (hashing it meanwhile), ``fsync`` it; return its manifest record."""
        digest = hash_pool().submit(sha256_segments, segments)
        path = self.path(relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            for index, seg in enumerate(segments):
                write_all(fd, seg)
                if midway_fault and index == len(segments) // 2:
                    fault.inject("mid_files")  # part of the file written, none of it fsynced
        except BaseException:
            os.close(fd)
            raise
        fsync_and_close(fd)
        return FileRecord(relpath, sum(_seg_size(s) for s in segments), digest.result())

    def commit(self, records: list[FileRecord], contents: Mapping, identity: Mapping, tensors: list[dict]) -> None:
        """Rank 0: manifest last, then rename into place and replace ``latest`` (all fsynced)."""
        for sub in sorted({os.path.dirname(self.path(r.path)) for r in records}, key=len, reverse=True):
            fsync_dir(sub)
        fault.inject("after_files")
        write_file_durably(self.path(layout.MANIFEST_NAME),
                           [build_manifest(self.step, records, contents, identity, tensors)])
        fsync_dir(self.partial)
        fault.inject("after_manifest")
        final = os.path.join(self.store.root, layout.step_dir_name(self.step))
        self.store.rename_into_place(self.partial, final, self.step, self.partial.rsplit("-", 1)[-1])
        fault.inject("after_rename")
        self.store.write_latest(layout.step_dir_name(self.step))
        fault.inject("after_latest")

    def abort(self) -> None:
        """Rank 0: remove the partial directory."""
        shutil.rmtree(self.partial, ignore_errors=True)


class _ObjectStep:
    """Files of one step written straight into an object store; the manifest commits them."""

    def __init__(self, store: ObjectStore, step: int) -> None:
        self.store, self.step = store, step

    def begin(self) -> None:
        """Rank 0: clear what an earlier attempt at this step left (never mix old and new files)."""
        if self.store.step_exists(self.step):
            self.store.delete_step(self.step)

    def path(self, relpath: str) -> str:
        """Object path of a file of the step."""
        return self.store._step_path(self.step, relpath)

    def write(self, relpath: str, segments: list, midway_fault: bool = False) -> FileRecord:
        """Upload one file (hashing it meanwhile); return its manifest record."""
        digest = hash_pool().submit(sha256_segments, segments)
        with self.store.fs.open(self.path(relpath), "wb") as f:
            for index, seg in enumerate(segments):
                f.write(seg)
                if midway_fault and index == len(segments) // 2:
                    fault.inject("mid_files")
        return FileRecord(relpath, sum(_seg_size(s) for s in segments), digest.result())

    def commit(self, records: list[FileRecord], contents: Mapping, identity: Mapping, tensors: list[dict]) -> None:
        """Rank 0: the manifest (a single PUT) is the commit point; then ``latest``."""
        fault.inject("after_files")
        self.store.commit_manifest(self.step, build_manifest(self.step, records, contents, identity, tensors))
        fault.inject("after_manifest")
        fault.inject("after_rename")
        self.store.write_latest(layout.step_dir_name(self.step))
        fault.inject("after_latest")

    def abort(self) -> None:
        """Rank 0: remove the uncommitted step."""
        with contextlib.suppress(Exception):
            self.store._remove_step(self.step)


def _seg_size(seg) -> int:
    return len(seg) if isinstance(seg, bytes) else seg.nbytes


def _open_step(store: Store, step: int, partial_name: str | None):
    if isinstance(store, PosixStore):
        return _PosixStep(store, step, os.path.join(store.root, partial_name))
    if isinstance(store, ObjectStore):
        return _ObjectStep(store, step)
    raise TypeError(f"sharded checkpoints are not supported on {type(store).__name__}")


def _error(exc: BaseException, where: str) -> str:
    return f"{where}: {exc}"


def save_sharded(manager, step: int, state: Mapping, group: Any = None) -> None:
    """Publish ``state`` as checkpoint ``step`` with every rank writing its own pieces (call on every rank).

    Every rank passes ``model``/``optimizer``/``ema`` as sharded state dicts (DTensor leaves are split by
    placement; plain tensors are taken from rank 0). Only rank 0's other keys are used: scheduler, scaler,
    progress, sampler, identity and ``rng`` (every rank's, gathered by the caller). ``manager`` is each rank's
    :class:`~worldpipe.checkpoint.manager.CheckpointManager` of the same root. Returns on every rank once the
    checkpoint is durable and ``latest`` names it; if any rank failed, raises CheckpointWriteError on every
    rank and the previous checkpoint stays ``latest``.
    """
    publish_shards(manager, step, shards.split_state(state), group)


def publish_shards(manager, step: int, local: shards.LocalShards, group: Any = None) -> None:
    """:func:`save_sharded` of a state already split (e.g. a snapshot of it); collective over ``group``."""
    coll = Collective(group)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fault.publishing(step))
        writer, own_error = None, None
        if coll.rank == 0:
            try:
                stack.enter_context(manager.store.writer_lock(step))
                writer = _begin(manager, step)
            except Exception as exc:
                own_error = exc
        partial_name, problem = coll.broadcast((getattr(writer, "partial", None) and
                                                os.path.basename(writer.partial),
                                                str(own_error) if own_error else None))
        if problem:
            _raise(own_error, step, manager.root, problem)
        if writer is None:
            writer = _open_step(manager.store, step, partial_name)
        rank0_records: list[FileRecord] = []
        contents: dict = {}
        record, problem = _write_own(writer, coll.rank, local)
        if coll.rank == 0 and problem is None:
            # The skeleton (everything not sharded) is written while the other ranks write their pieces.
            rank0_records, contents, problem = _write_skeleton(writer, local.skeleton)
        gathered = coll.gather((record, local.pieces, problem))
        outcome, own_error = None, None
        if coll.rank == 0:
            own_error = _commit(writer, step, local, gathered, rank0_records, contents)
            outcome = str(own_error) if own_error else None
        outcome = coll.broadcast(outcome)
        if outcome:
            _raise(own_error, step, manager.root, outcome)
    if coll.rank == 0:
        manager.retain_after(step)


def _raise(own: BaseException | None, step: int, root: str, problem: str):
    if own is not None:
        raise own
    raise CheckpointWriteError(step, root, problem)


def _begin(manager, step: int):
    try:
        removed = manager.store.remove_leftovers()
    except OSError as exc:
        raise CheckpointWriteError(step, manager.root, f"cannot remove leftovers: {exc}") from exc
    for path in removed:
        logger.warning("removed leftover of an interrupted save or deletion: %s", path)
    partial_name = layout.temp_name(step, "partial", secrets.token_hex(6))
    writer = _open_step(manager.store, step, partial_name)
    try:
        if isinstance(manager.store, PosixStore):
            manager.store._ensure_root()
        fault.inject("before_files")
        writer.begin()
    except OSError as exc:
        writer.abort()
        raise CheckpointWriteError(step, getattr(writer, "partial", manager.root), exc) from exc
    return writer


def _write_own(writer, rank: int, local: shards.LocalShards) -> tuple[FileRecord | None, str | None]:
    """This rank's shard file (None when it holds no piece), or the problem that stopped it."""
    if not local.local:
        return None, None
    relpath = shards.shard_file(rank)
    try:
        return writer.write(relpath, encode_with_fallback(local.local, archive="shards").segments,
                            midway_fault=True), None
    except (OSError, ValueError, TypeError) as exc:  # reported at the gather: no rank is left waiting
        return None, _error(exc, writer.path(relpath))


def _write_skeleton(writer, skeleton: Mapping) -> tuple[list[FileRecord], dict, str | None]:
    files: list[PendingFile]
    try:
        files, contents = encode_state(skeleton)
    except ValueError as exc:  # an invalid state: every rank must still reach the gather, then fail
        return [], {}, f"invalid state: {exc}"
    records = []
    for pending in files:
        try:
            records.append(writer.write(pending.relpath, pending.segments))
        except OSError as exc:
            return records, contents, _error(exc, writer.path(pending.relpath))
    return records, contents, None


def _commit(writer, step: int, local: shards.LocalShards, gathered: list, rank0_records: list[FileRecord],
            contents: dict) -> BaseException | None:
    """Rank 0: index, manifest, rename, ``latest``; on any rank's failure remove the partial step."""
    try:
        problems = [p for _, _, p in gathered if p]
        if problems:
            raise CheckpointWriteError(step, writer.path(""), "; ".join(problems))
        index = shards.build_index(local.tensors, [pieces for _, pieces, _ in gathered])
        records = [r for r, _, _ in gathered if r is not None] + rank0_records
        records.append(writer.write(shards.INDEX_FILE, [json_bytes(index)]))
        contents[shards.CONTENTS_KEY] = {"index": shards.INDEX_FILE, "world_size": len(gathered),
                                         "files": sorted(r.path for r, _, _ in gathered if r is not None)}
        writer.commit(records, contents, local.skeleton.get(layout.IDENTITY) or {},
                      tensor_table(local.skeleton, local.tensors))
    except Exception as exc:
        writer.abort()
        return exc if isinstance(exc, CheckpointWriteError) else CheckpointWriteError(step, writer.path(""), exc)
    return None


"""ShardedSaver: sharded checkpoints, synchronous or in the background (collective: one per rank).

Every rank writes its own pieces; the publication protocol is :mod:`.publication`'s, split across ranks
(:func:`publish_shards`):

1. rank 0 takes the writer lock and begins the step (leftovers removed, the step's place made) and broadcasts
   where it is written (its writer's token);
2. every rank writes ``shards/rank-NNNNN.pt`` (its local pieces), hashed meanwhile and durable before its record
   is handed on; rank 0 meanwhile writes the skeleton (every non-sharded part, see :mod:`.shards`);
3. rank 0 gathers every rank's record and pieces, writes ``shards/index.json`` and commits (manifest last);
4. rank 0 broadcasts the outcome: every rank returns, or every rank raises CheckpointWriteError.

A rank killed anywhere before the commit leaves only what readers never see (a hidden partial directory, or on
object stores a step without a manifest), which the next save removes.

Async: ``save`` splits the state into this rank's pieces and snapshots them, deferring the copy of what
``optimizer.step()`` writes to a thread (:mod:`.deferred_copy`: awaited by a step pre-hook); the publication
then runs on a background thread of every rank. Its collectives use a process group of their own (gloo,
created once by the constructor on every rank), so they never interleave with the training's collectives on
the default group. One save is in flight at a time; the next ``save`` (and ``wait``/``close``) first waits for
it and raises its failure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from . import fault, layout, shards
from .codec import PendingFile, encode_state, json_bytes
from .deferred_copy import DeferredCopy, guard_optimizer, step_mutated
from .digest import state_digest
from .errors import CheckpointWriteError
from .manifest import FileRecord
from .publication import Publication
from .resharding import lazy_state
from .state import snapshot_state, validate_state
from .structure import tensor_table
from .tensorfile import encode_with_fallback
from .thread_pool import background_executor

logger = logging.getLogger("worldpipe.checkpoint")


class ShardedSaver:
    """Saves sharded checkpoints of one run into ``manager``'s store; call every method on every rank."""

    def __init__(self, manager, async_save: bool = False, digest: bool = False) -> None:
        self.manager = manager
        self.async_save = async_save
        self.digest = digest
        # (step, digest) of saves found durable, oldest first; the digest (over the logical tensors, streamed
        # from the published shards on rank 0's writer thread) only with ``digest`` and only on rank 0.
        self.durable: list[tuple[int, str | None]] = []
        distributed = dist.is_available() and dist.is_initialized()
        # A group of its own: background collectives must not interleave with the trainer's.
        self._group = dist.new_group(backend="gloo") if async_save and distributed else None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._copy: DeferredCopy | None = None
        self._buffers: dict = {}
        self._guards: dict[int, Any] = {}

    def save(self, step: int, state: Mapping, optimizer: torch.optim.Optimizer | None = None,
             wait: bool = False) -> None:
        """Publish ``state`` as checkpoint ``step`` with every rank writing its own pieces (call on every rank).

        Every rank passes ``model``/``optimizer``/``ema`` as sharded state dicts (DTensor leaves are split by
        placement; plain tensors are taken from rank 0). Only rank 0's other keys are used: scheduler, scaler,
        progress, sampler, identity and ``rng`` (every rank's, gathered by the caller). If any rank fails, every
        rank raises CheckpointWriteError and the previous checkpoint stays ``latest``.

        Sync: returns once durable and ``latest`` names it. Async: returns after the snapshot (the copy of what
        ``optimizer.step()`` writes continues in the background when ``optimizer`` is given). ``wait`` (every rank
        alike): publish on this thread, as a sync save does (a final save is waited for anyway; see
        CheckpointManager.save).
        """
        layout.step_dir_name(step)
        if layout.MODEL in state and not isinstance(state[layout.MODEL], Mapping):
            raise ValueError("state['model'] must be a dict of tensors")
        self.wait()
        local = shards.split_state(state)
        if not self.async_save or wait:
            self._publish(step, local, None)
            return
        if local.skeleton.get(layout.PROGRESS) is not None:
            validate_state(local.skeleton)  # rank 0: fail here, not in the background
        pairs: list = []
        defer = step_mutated(optimizer) if optimizer is not None else None
        record: dict = {}
        local.local = snapshot_state(local.local, reuse=self._buffers, record=record, defer=defer, deferred=pairs)
        local.skeleton = snapshot_state(local.skeleton)
        self._buffers = record
        self._copy = DeferredCopy(pairs) if pairs else None
        if optimizer is not None and id(optimizer) not in self._guards:
            self._guards[id(optimizer)] = guard_optimizer(optimizer, self.before_optimizer_step)
        if self._executor is None:  # one long-lived thread: no thread start on the training thread's clock
            self._executor = background_executor("ckpt-sharded-writer")
        self._inflight = self._executor.submit(self._publish, step, local, self._copy)

    def _publish(self, step: int, local: shards.LocalShards, copy: DeferredCopy | None) -> None:
        try:
            if copy is not None:
                copy.wait()
            publish_shards(self.manager, step, local, self._group if self.async_save else None)
            digest = None
            if self.digest and local.skeleton.get(layout.PROGRESS) is not None:  # rank 0
                digest = state_digest(lazy_state(self.manager, step, verify=False))
            self.durable.append((step, digest))
        except BaseException as exc:
            # Logged now (the process may never call save/wait/close again) and re-raised by wait().
            logger.error("sharded save of step %d failed: %s", step, exc)
            raise

    def before_optimizer_step(self) -> None:
        """Block until the background copy of the last save is complete (the optimizer may step then)."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.wait()

    def wait(self) -> None:
        """Block until the in-flight save is published on this rank; raise its failure."""
        future, self._inflight = self._inflight, None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for the in-flight save (raising its failure); remove the optimizer hooks."""
        try:
            self.wait()
        finally:
            for handle in self._guards.values():
                handle.remove()
            self._guards = {}
            self._buffers = {}
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def local_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's model and optimizer state dicts as they are laid out (DTensors stay sharded, no gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    module = model.module if isinstance(model, DistributedDataParallel) else model
    return get_model_state_dict(module), get_optimizer_state_dict(module, optimizer)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True when any parameter is a DTensor (FSDP2, tensor parallel): such models are saved sharded."""
    return any(shards.is_dtensor(p) for p in model.parameters())


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


def publish_shards(manager, step: int, local: shards.LocalShards, group: Any = None) -> None:
    """Publish ``local`` (this rank's part of a state split by :func:`.shards.split_state`) as checkpoint ``step``
    into ``manager``'s store, then apply retention on rank 0; collective over ``group``."""
    coll = Collective(group)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fault.publishing(step))
        publication, own_error = None, None
        if coll.rank == 0:
            try:
                stack.enter_context(manager.store.writer_lock(step))
                publication = Publication.begin(manager.store, step)
            except Exception as exc:
                own_error = exc
        token, problem = coll.broadcast((publication and publication.token, str(own_error) if own_error else None))
        if problem:
            _raise(own_error, step, manager.root, problem)
        if publication is None:
            publication = Publication.join(manager.store, step, token)
        record, problem = _write_own(publication, coll.rank, local)
        rank0_records: list[FileRecord] = []
        contents: dict = {}
        if coll.rank == 0 and problem is None:
            # The skeleton (everything not sharded) is written while the other ranks write their pieces.
            rank0_records, contents, problem = _write_skeleton(publication, local.skeleton)
        gathered = coll.gather((record, local.pieces, problem))
        outcome, own_error = None, None
        if coll.rank == 0:
            own_error = _commit(publication, local, gathered, rank0_records, contents)
            outcome = str(own_error) if own_error else None
        outcome = coll.broadcast(outcome)
        if outcome:
            _raise(own_error, step, manager.root, outcome)
        if coll.rank == 0:  # under the writer lock and at the step's fault phases, as a full save's retention
            manager.retain_after(step)


def _raise(own: BaseException | None, step: int, root: str, problem: str):
    if own is not None:
        raise own
    raise CheckpointWriteError(step, root, problem)


def _problem(exc: Exception) -> str:
    """One rank's failure as one line for rank 0 to report (the file it touched, then the cause)."""
    return f"{exc.path}: {exc.cause}" if isinstance(exc, CheckpointWriteError) else str(exc)


def _write_own(publication: Publication, rank: int,
               local: shards.LocalShards) -> tuple[FileRecord | None, str | None]:
    """This rank's shard file (None when it holds no piece), or the problem that stopped it."""
    if not local.local:
        return None, None
    try:
        encoded = encode_with_fallback(local.local, archive="shards")
        (record,) = publication.write([PendingFile(shards.shard_file(rank), encoded.segments)])
    except (CheckpointWriteError, ValueError, TypeError) as exc:  # reported at the gather: no rank left waiting
        return None, _problem(exc)
    return record, None


def _write_skeleton(publication: Publication, skeleton: Mapping) -> tuple[list[FileRecord], dict, str | None]:
    try:
        files, contents = encode_state(skeleton)
    except ValueError as exc:  # an invalid state: every rank must still reach the gather, then fail
        return [], {}, f"invalid state: {exc}"
    try:
        return publication.write(files), contents, None
    except CheckpointWriteError as exc:
        return [], contents, _problem(exc)


def _commit(publication: Publication, local: shards.LocalShards, gathered: list, rank0_records: list[FileRecord],
            contents: dict) -> BaseException | None:
    """Rank 0: index, then the commit; on any rank's failure the step is discarded."""
    step = publication.step
    try:
        problems = [p for _, _, p in gathered if p]
        if problems:
            raise CheckpointWriteError(step, publication.writer.path(), "; ".join(problems))
        index = shards.build_index(local.tensors, [pieces for _, pieces, _ in gathered])
        records = [r for r, _, _ in gathered if r is not None] + rank0_records
        records += publication.write([PendingFile(shards.INDEX_FILE, [json_bytes(index)])])
    except Exception as exc:
        publication.discard()
        if isinstance(exc, CheckpointWriteError):
            return exc
        return CheckpointWriteError(step, publication.writer.path(), exc)
    contents[shards.CONTENTS_KEY] = {"index": shards.INDEX_FILE, "world_size": len(gathered),
                                     "files": sorted(r.path for r, _, _ in gathered if r is not None)}
    try:
        publication.commit(records, contents, local.skeleton.get(layout.IDENTITY) or {},
                           tensor_table(local.skeleton, local.tensors))
    except CheckpointWriteError as exc:  # the commit discarded the step if it failed before the step was shown
        return exc
    return None

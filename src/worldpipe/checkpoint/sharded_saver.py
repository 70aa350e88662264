"""ShardedSaver: sharded checkpoints, synchronous or in the background (collective: one per rank).

The publication protocol is :mod:`.publication`'s, split across ranks (:func:`publish_shards`): rank 0 begins
the step under the writer lock and broadcasts where it is written (its writer's token); every rank writes its
own pieces (``shards/rank-NNNNN.pt``), rank 0 meanwhile the skeleton (every non-sharded part, :mod:`.shards`);
rank 0 gathers every rank's record, writes ``shards/index.json``, commits and broadcasts the outcome: every rank
returns, or every rank raises CheckpointWriteError. A rank killed before the commit leaves only what readers
never see, which the next save removes.

Async: the manager's writer (:mod:`.async_writer`) publishes on a background thread of every rank. Its
collectives use a process group of their own (gloo, created once by the constructor on every rank), so they
never interleave with the training's collectives on the default group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from worldpipe.parallel.runtime import broadcast_object, gather_objects, group_runtime
from worldpipe.parallel.wrap import unwrap

from . import fault, layout, shards
from .async_writer import AsyncWriter
from .codec import PendingFile, encode_state, json_bytes
from .digest import state_digest
from .errors import CheckpointWriteError
from .loadable import tensor_table
from .manifest import FileRecord
from .publication import Publication
from .resharding import lazy_state
from .state import snapshot_state, validate_state
from .tensorfile import encode_with_fallback


class ShardedSaver:
    """Says how a sharded checkpoint of one run is published into ``manager``'s store; :meth:`save` (on every
    rank) runs it through the manager's writer (``manager.wait()``/``close()`` wait for it, as for a full save).
    ``digest``: this rank digests each published step (rank 0's Checkpointer reports it)."""

    def __init__(self, manager, async_save: bool = False, digest: bool = False) -> None:
        self.manager = manager
        self.async_save = async_save
        self.digest = digest
        self.writer: AsyncWriter = manager.writer
        distributed = dist.is_available() and dist.is_initialized()
        # A group of its own: background collectives must not interleave with the trainer's.
        self._group = dist.new_group(backend="gloo") if async_save and distributed else None

    def save(self, step: int, state: Mapping, optimizer: torch.optim.Optimizer | None = None,
             wait: bool = False) -> None:
        """Publish ``state`` as checkpoint ``step`` with every rank writing its own pieces (call on every rank).

        Every rank passes ``model``/``optimizer``/``ema`` as sharded state dicts (DTensor leaves are split by
        placement; plain tensors are taken from rank 0). Only rank 0's other keys are used: scheduler, scaler,
        progress, sampler, identity and ``rng`` (every rank's, gathered by the caller). If any rank fails, every
        rank raises CheckpointWriteError and the previous checkpoint stays ``latest``. Sync, async, ``optimizer``
        and ``wait`` (every rank alike) as for :meth:`CheckpointManager.save`.
        """
        layout.step_dir_name(step)
        if layout.MODEL in state and not isinstance(state[layout.MODEL], Mapping):
            raise ValueError("state['model'] must be a dict of tensors")
        self.writer.wait()
        local = shards.split_state(state)
        if not self.async_save or wait:
            self.writer.run(step, lambda: self._publish(step, local))
            return
        if local.skeleton.get(layout.PROGRESS) is not None:
            validate_state(local.skeleton)  # rank 0: fail here, not in the background
        local.local = self.writer.snapshot(local.local, optimizer)
        local.skeleton = snapshot_state(local.skeleton)
        self.writer.submit(step, lambda: self._publish(step, local))

    def _publish(self, step: int, local: shards.LocalShards) -> str | None:
        publish_shards(self.manager, step, local, self._group)
        if self.digest and local.skeleton.get(layout.PROGRESS) is not None:  # rank 0
            return state_digest(lazy_state(self.manager, step))
        return None


def local_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's model and optimizer state dicts as they are laid out (DTensors stay sharded, no gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = unwrap(model)
    return get_model_state_dict(module), get_optimizer_state_dict(module, optimizer)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True when any parameter is a DTensor (FSDP2, tensor parallel): such models are saved sharded."""
    return any(shards.is_dtensor(p) for p in model.parameters())


def publish_shards(manager, step: int, local: shards.LocalShards, group: Any = None) -> None:
    """Publish ``local`` (this rank's part of a state split by :func:`.shards.split_state`) as checkpoint ``step``
    into ``manager``'s store, then apply retention on rank 0; collective over ``group``."""
    runtime = group_runtime(group)
    with contextlib.ExitStack() as stack:
        stack.enter_context(fault.publishing(step))
        publication, own_error = None, None
        if runtime.rank == 0:
            try:
                stack.enter_context(manager.store.writer_lock(step))
                publication = Publication.begin(manager.store, step)
            except Exception as exc:
                own_error = exc
        token, problem = broadcast_object(runtime, (publication and publication.writer.token,
                                                    str(own_error) if own_error else None), group)
        if problem:
            _raise(own_error, step, manager.root, problem)
        if publication is None:
            publication = Publication(manager.store, step, token)
        records, _, problem = _write(publication, lambda: (  # this rank's shard file; none without a piece
            [PendingFile(shards.shard_file(runtime.rank), encode_with_fallback(local.local, archive="shards"))]
            if local.local else [], {}))
        rank0_records: list[FileRecord] = []
        contents: dict = {}
        if runtime.rank == 0 and problem is None:
            # The skeleton (everything not sharded) is written while the other ranks write their pieces.
            rank0_records, contents, problem = _write(publication, lambda: encode_state(local.skeleton))
        gathered = gather_objects(runtime, (records[0] if records else None, local.pieces, problem), group)
        outcome, own_error = None, None
        if runtime.rank == 0:
            own_error = _commit(publication, local, gathered, rank0_records, contents)
            outcome = str(own_error) if own_error else None
        outcome = broadcast_object(runtime, outcome, group)
        if outcome:
            _raise(own_error, step, manager.root, outcome)
        if runtime.rank == 0:  # under the writer lock and at the step's fault phases, as a full save's retention
            manager.retain_after(step)


def _raise(own: BaseException | None, step: int, root: str, problem: str):
    if own is not None:
        raise own
    raise CheckpointWriteError(step, root, problem)


def _write(publication: Publication, encode: Callable[[], tuple[list[PendingFile], dict]]
           ) -> tuple[list[FileRecord], dict, str | None]:
    """This rank's files encoded and written, or the problem that stopped it: reported at the gather, so no rank is
    left waiting (and every rank fails there)."""
    try:
        files, contents = encode()
        return publication.write(files), contents, None
    except CheckpointWriteError as exc:
        return [], {}, f"{exc.path}: {exc.cause}"  # the file it touched, then the cause
    except (ValueError, TypeError) as exc:
        return [], {}, f"invalid state: {exc}"


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
        publication.writer.discard()
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

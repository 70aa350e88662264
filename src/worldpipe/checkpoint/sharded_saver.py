"""ShardedSaver: sharded checkpoints, synchronous or in the background (collective: one per rank).

Async: ``save`` splits the state into this rank's pieces and snapshots them, deferring the copy of what
``optimizer.step()`` writes to a thread (:mod:`.deferred_copy`: awaited by a step pre-hook); the publication
(:func:`.sharded_publication.publish_shards`) then runs on a background thread of every rank. Its
collectives use a process group of their own (gloo, created once by the constructor on every rank), so they
never interleave with the training's collectives on the default group. One save is in flight at a time; the
next ``save`` (and ``wait``/``close``) first waits for it and raises its failure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from . import layout, shards
from .deferred_copy import DeferredCopy, guard_optimizer, step_mutated
from .digest import state_digest
from .resharding import lazy_state
from .sharded_publication import publish_shards
from .state import snapshot_state, validate_state
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
        """Publish ``state`` (see :func:`.sharded_publication.save_sharded` for what each rank passes).

        Sync: returns once durable. Async: returns after the snapshot (the copy of what ``optimizer.step()``
        writes continues in the background when ``optimizer`` is given). ``wait`` (every rank alike): publish on
        this thread, as a sync save does (a final save is waited for anyway; see CheckpointManager.save).
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

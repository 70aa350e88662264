"""The one writer of checkpoint saves, full and sharded: what they publish is said by their owners
(:class:`.manager.CheckpointManager`, :class:`.sharded_saver.ShardedSaver`); how a save runs is said here.

A save is published on the caller's thread (sync), or in the background (async): the state is snapshotted (its
buffers reused from the previous snapshot, which is published by then), and the publication runs on one writer
thread, one save at a time and in order. Every save found published joins the durability queue
(:attr:`AsyncWriter.durable`), from which the Checkpointer reports it, full or sharded alike.

Parameters and optimizer state change only inside ``optimizer.step()``. So the snapshot copy of those tensors
need not stall the loop: it runs on a thread while the next step's forward and backward run, and only has to
be complete before that step's optimizer update. :func:`step_mutated` says which tensors qualify (their storage
belongs to a parameter or a per-parameter state tensor of the optimizer); everything else (buffers, RNG
states, anything a forward pass may change) is still copied synchronously, so correctness never depends on
the trainer's order of calls beyond "the copy is awaited before ``optimizer.step()``", which a step pre-hook
enforces (the optimizer guard). A small state (below :data:`DEFER_MIN_BYTES`) is copied at once instead: there
the deferral costs the steps more than the copy it defers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .state import snapshot_state
from .thread_pool import enter_background, shared_pool

logger = logging.getLogger("worldpipe.checkpoint")

# Below this many bytes of parameters and optimizer state, the training thread copies them itself, with the rest of
# the snapshot. Handing a small copy to the copy thread costs more than the copy (docs/benchmarks.md, "checkpoint":
# the smoke model's async save step with and without the deferred copy); a copy of 16 MiB costs about what
# deferring it does.
DEFER_MIN_BYTES = 16 << 20


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's storage is its local shard's
    return to_local() if callable(to_local) else t


def step_mutated(optimizer: torch.optim.Optimizer,
                 min_bytes: int | None = None) -> Callable[[torch.Tensor], bool] | None:
    """Predicate: does ``tensor`` share storage with what ``optimizer.step()`` writes (params, their state)?

    None (copy everything now) when those tensors hold fewer than ``min_bytes`` (default :data:`DEFER_MIN_BYTES`).
    """
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    sizes = {s.data_ptr(): s.nbytes() for s in (_local(t).untyped_storage() for t in tensors)}
    sizes.pop(0, None)
    if sum(sizes.values()) < (DEFER_MIN_BYTES if min_bytes is None else min_bytes):
        return None
    return lambda t: _local(t).untyped_storage().data_ptr() in sizes


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(_local(src))
    pairs.clear()  # drop references to the live tensors


def deferred_copy(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Future:
    """Copy ``(destination, source)`` pairs on the copy thread (``copy_`` releases the GIL); the future's
    ``result()`` waits for every copy and raises the copy's failure, if any."""
    # One thread: the copies of a snapshot run in order.
    return shared_pool("ckpt-snapshot-copy", 1).submit(_copy_all, list(pairs))


class AsyncWriter:
    """Runs the saves of one checkpoint root, sync or in the background (one writer thread per process role).

    ``background_priority``: the writer thread runs at the lowest CPU priority (False: a benchmark's before).
    """

    def __init__(self, background_priority: bool = True) -> None:
        self.background_priority = background_priority
        # (step, digest or None) of saves found published, oldest first; appended by the writer thread, so its
        # owner pops (never clears) them.
        self.durable: list[tuple[int, str | None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._buffers: dict = {}
        self._copy: Future | None = None
        self._guards: dict[int, object] = {}  # id(optimizer) -> step pre-hook handle

    def snapshot(self, state: Mapping, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """A copy of ``state`` that training may keep changing (call after :meth:`wait`: the previous snapshot's
        buffers are reused). With ``optimizer``, what its ``step()`` writes is copied on the copy thread, and its
        next ``step()`` waits for that copy (a step pre-hook, or call :meth:`before_optimizer_step`)."""
        buffers: dict = {}
        pairs: list = []
        snapshot = snapshot_state(state, reuse=self._buffers, record=buffers,
                                  defer=step_mutated(optimizer) if optimizer is not None else None, deferred=pairs)
        self._buffers = buffers
        self._copy = deferred_copy(pairs) if pairs else None
        if optimizer is not None and id(optimizer) not in self._guards:
            self._guards[id(optimizer)] = optimizer.register_step_pre_hook(
                lambda _opt, _args, _kwargs: self.before_optimizer_step())
        return snapshot

    def run(self, step: int, publish: Callable[[], str | None]) -> None:
        """Publish ``step`` on this thread (``publish()`` returns its digest, or None); durable on return."""
        self.durable.append((step, publish()))

    def submit(self, step: int, publish: Callable[[], str | None]) -> None:
        """Publish ``step`` on the writer thread, once the snapshot's deferred copy is complete."""
        if self._executor is None:  # one long-lived thread: no thread start on the training thread's clock
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer",
                                                initializer=enter_background if self.background_priority else None)
        self._inflight = self._executor.submit(self._in_background, step, publish, self._copy)

    def _in_background(self, step: int, publish: Callable[[], str | None], copy: Future | None) -> None:
        try:
            if copy is not None:
                copy.result()
            self.run(step, publish)
        except BaseException as exc:
            # Logged now (the process may never call save/wait/close again) and re-raised by wait().
            logger.error("background save of step %d failed: %s", step, exc)
            raise

    def before_optimizer_step(self) -> None:
        """Block until the background copy of the last snapshot is complete (the optimizer may step then)."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.result()

    def publishing(self) -> bool:
        """True while a save is still being published in the background (never blocks)."""
        return self._inflight is not None and not self._inflight.done()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is published; raise its failure."""
        future, self._inflight = self._inflight, None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for the in-flight save (raising its failure); remove the optimizer hooks, stop the thread."""
        try:
            self.wait()
        finally:
            for handle in self._guards.values():
                handle.remove()
            self._guards, self._buffers = {}, {}
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

"""The Checkpointer: the one owner of the state contract during training.

The trainer hands it the run's stateful components (model, optimizer, scheduler, loader, progress, named RNG
streams, identity); the Checkpointer decides when to save (``cfg.checkpoint``), assembles the state dict from the
components (keys from :mod:`.layout`), publishes it through :class:`CheckpointManager`, and on resume loads the
newest intact step and restores every component from it. What happens around a publication (journaling metrics,
recording artifacts) is the caller's business, through a :class:`CheckpointListener`: this package never
imports tracking code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from worldpipe.parallel.runtime import Runtime, broadcast_object, gather_objects
from worldpipe.parallel.wrap import full_states, load_full_state, unwrap

from . import layout, shards
from .digest import state_digest
from .manager import CheckpointManager, checkpoint_digest
from .resharding import is_sharded, load_resharded
from .sharded_saver import ShardedSaver, is_sharded_model, local_state_dicts
from .state import capture_rng, restore_rng

log = logging.getLogger("worldpipe.checkpoint")


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (schedulers, loaders, :class:`Progress`)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Progress:
    """How far the run has come: optimizer steps, epochs, samples and valid tokens seen (global counts)."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        """The fields of ``layout.PROGRESS_FIELDS`` as plain ints."""
        return {name: int(getattr(self, name)) for name in layout.PROGRESS_FIELDS}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore every field (missing ones stay as they are)."""
        for name in layout.PROGRESS_FIELDS:
            if name in state:
                setattr(self, name, int(state[name]))


@dataclass
class TrainingComponents:
    """Everything whose state the algorithm's future depends on, as live objects."""

    model: torch.nn.Module  # possibly wrapped (DDP) or sharded (FSDP2)
    optimizer: torch.optim.Optimizer
    scheduler: Stateful | None
    loader: Stateful  # owns the sampler: seed, epoch, cursor into the global order
    progress: Progress
    identity: dict[str, Any]
    torch_generators: dict[str, torch.Generator] = field(default_factory=dict)
    # True when each rank holds only its pipeline stage's tensors: saved per stage, as the whole model's state.
    stages: bool = False


# What a listener is given of each durable checkpoint: small, and copied by capture() (never the live tensors).
RECORDED_KEYS = (layout.PROGRESS, layout.SAMPLER, layout.RNG)


class CheckpointListener(Protocol):
    """Hooks around a publication (rank 0 only)."""

    def before_publish(self, step: int, final: bool) -> None:
        """Called just before step ``step`` is handed to the store (``final``: the run's last save)."""

    def durable(self, step: int, records: Mapping[str, Any], digest: str | None) -> None:
        """Called once step ``step`` is durable (async: when a poll or a later save finds it published),
        with its progress, sampler and RNG state (``RECORDED_KEYS``) and its digest."""


@dataclass(frozen=True)
class Resumed:
    """What a resume restored: the step and the identity recorded with it."""

    step: int
    identity: dict[str, Any]


class Checkpointer:
    """Saves and restores the training state of one run; collective calls run on every rank."""

    def __init__(self, cfg: Mapping[str, Any], runtime: Runtime, components: TrainingComponents,
                 listener: CheckpointListener | None = None) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.components = components
        self.listener = listener
        self.every = cfg.get("every")  # read at every step: a plain int, not a config lookup
        self.manager = CheckpointManager(cfg["dir"], keep_last=cfg["keep_last"], keep_every=cfg["keep_every"],
                                         async_save=cfg["async_save"], verify=cfg["verify"])
        # A DTensor-sharded model (FSDP2, TP) or one cut into pipeline stages is saved sharded: every rank writes
        # its own pieces, none gathers.
        self.saver = (ShardedSaver(self.manager, async_save=cfg["async_save"], digest=runtime.is_main)
                      if components.stages or is_sharded_model(components.model) else None)
        # Rank 0, with a listener: (records, digest) of each save not yet reported durable. The digest of a sharded
        # save is computed once it is published (the writer's durability queue brings it).
        self._undurable: dict[int, tuple[dict, str | None]] = {}

    # ---- cadence ----
    def should_save(self, step: int, final: bool) -> bool:
        """Every ``checkpoint.every`` steps, and always at the last step of a run (finished or preempted)."""
        return final or step % self.every == 0

    # ---- resume ----
    def resume(self, check_identity: Callable[[dict, int], None]) -> Resumed | None:
        """Restore every component from the newest loadable checkpoint (None when there is none).

        Every rank names its tensors' logical shapes (a DTensor's is its global one; no communication); rank 0
        chooses the newest step that loads into them (:mod:`.loadable`: a sharded step's shards are opened and
        checked, never assembled in one process; each step skipped is reported); every rank loads that step.
        ``check_identity(identity, step)`` may refuse it by raising.
        """
        expected = {name: list(t.shape) for name, t in unwrap(self.components.model).state_dict().items()}
        if self.components.stages:  # each rank names its stage's tensors: the checkpoint holds all of them
            expected = shards.join_shapes(self.runtime, expected)
        chosen = self.manager.latest_loadable(expected, keep=self.saver is None) if self.runtime.is_main else None
        step = broadcast_object(self.runtime, chosen)
        if step is None:
            return None
        c = self.components
        sharded = self.saver is not None or is_sharded(self.manager, step)
        state = self.manager.load(step, keys={layout.IDENTITY} if sharded else None)
        identity = state[layout.IDENTITY]
        check_identity(identity, step)
        if sharded:  # each rank reads only the regions its own tensors cover, whatever layout wrote the step
            state = load_resharded(self.manager, step, c.model, c.optimizer)
        else:
            load_full_state(c.model, c.optimizer, state[layout.MODEL], state[layout.OPTIMIZER])  # FSDP2: collective
        if c.scheduler is not None:
            c.scheduler.load_state_dict(state[layout.SCHEDULER])
        c.loader.load_state_dict(state[layout.SAMPLER])
        c.progress.load_state_dict(state[layout.PROGRESS])
        rng = state[layout.RNG]
        # Per-rank streams restore to the same rank. On another world size ranks map to different data and the
        # streams start fresh; noise that shapes the math is keyed by sample index, not by rank.
        if len(rng) == self.runtime.world_size:
            restore_rng(rng[self.runtime.rank], c.torch_generators)
        return Resumed(step, identity)

    # ---- save ----
    def capture(self, sharded: bool = False) -> dict[str, Any] | None:
        """The full state on rank 0 (None elsewhere); collective: every rank must call it.

        ``sharded``: every rank's own shards of model and optimizer instead (the rest only on rank 0).
        """
        c = self.components
        if sharded:
            model_state, optim_state = local_state_dicts(c.model, c.optimizer)
            if c.stages:
                model_state, optim_state = shards.join_stages(self.runtime, model_state, optim_state)
        else:
            model_state, optim_state = full_states(c.model, c.optimizer)
        rng = gather_objects(self.runtime, capture_rng(c.torch_generators))
        if not self.runtime.is_main:
            return {layout.MODEL: model_state, layout.OPTIMIZER: optim_state} if sharded else None
        return {
            layout.MODEL: model_state,
            layout.OPTIMIZER: optim_state,
            layout.SCHEDULER: c.scheduler.state_dict() if c.scheduler is not None else None,
            layout.SCALER: None,  # no AMP in this trainer: the contract stores only what the run uses
            layout.EMA: None,
            layout.PROGRESS: c.progress.state_dict(),
            layout.SAMPLER: c.loader.state_dict(),
            layout.RNG: rng,
            layout.IDENTITY: c.identity,
        }

    def save(self, step: int, final: bool) -> str | None:
        """Publish the current state as ``step``; returns its digest on rank 0 when it is known now (None elsewhere).

        Sync saves are durable on return. Async saves return once the snapshot is taken; their listener's
        ``durable`` runs when :meth:`poll` (the trainer's, every step) or the next save finds them published.
        The digest of a full save is computed before it is handed over; a sharded save's, streamed from its
        published shards (no rank ever holds the whole state), comes with its durability.
        """
        sharded = self.saver is not None
        state = self.capture(sharded=sharded)
        if state is None:
            return None
        main = self.runtime.is_main
        if main and self.listener is not None:
            self.listener.before_publish(step, final)
        # Before the next step changes the live tensors, and before a background writer starts: its Python work
        # would hold the GIL while this thread hashes.
        digest = state_digest(state) if main and not sharded else None
        # The previous async publication is waited for by save() anyway: report it durable first, for the same
        # reason.
        self.manager.wait()
        self._report_durable()
        if main and self.listener is not None:
            self._undurable[step] = ({k: state[k] for k in RECORDED_KEYS}, digest)
        # Async: the copy of what optimizer.step() writes overlaps the next forward/backward (a step pre-hook waits).
        # The final save is waited for: it publishes on this thread, not on the background-priority writer.
        (self.saver or self.manager).save(step, state, optimizer=self.components.optimizer, wait=final)
        return self._report_durable().get(step) or digest

    def poll(self) -> None:
        """Report the saves the writer has found published since (a check per step; never waits, never raises: a
        failed publication is raised by the next save, on every rank alike).

        Their metrics are then released, and their records journaled, right after the writer finishes, rather
        than one cadence later at the next save, where they met the next publication: the courier delivering them
        at the same time as a background-priority writer ran left the training thread waiting for the GIL
        (`worldpipe bench loop`, async checkpoints with tracking).
        """
        if self._undurable and self.manager.writer.durable:
            self._report_durable()

    def _report_durable(self) -> dict[int, str | None]:
        """Tell the listener of every save the writer has found published; returns their digests by step."""
        digests = {}
        writer = self.manager.writer
        while writer.durable:  # appended by the writer thread: pop, never clear
            step, digest = writer.durable.pop(0)
            records, known = self._undurable.pop(step, (None, None))
            digests[step] = digest or known
            if records is not None:
                self.listener.durable(step, records, digests[step])
        return digests

    def digest(self, step: int) -> str:
        """Digest of a published step (used when a run resumes at its final step and saves nothing)."""
        return checkpoint_digest(self.cfg["dir"], step)

    def close(self) -> None:
        """Wait for an in-flight async save (raising its failure) and stop the writer thread (full and sharded
        saves share the manager's)."""
        self.manager.close()

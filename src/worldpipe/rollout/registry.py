"""Served models: load published checkpoints (verified against their manifests), know them by version.

The *model version* of a checkpoint is its state digest (:func:`worldpipe.checkpoint.state_digest`, what
``worldpipe ckpt digest`` prints): a content hash of the whole training state, so two directories holding the
same bits are the same version and a newly published step under the same run is a different one.

The registry resolves its checkpoint path once (a ``latest`` link is followed when the server starts, never
again: a pipeline that moves ``latest`` to another run does not change what is served) and
:meth:`ModelRegistry.refresh` loads the newest loadable step of that run when it changed. Older versions stay
loaded while a session still uses them (:meth:`ModelRegistry.pin`); a version
nobody pins is dropped at the next refresh.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worldpipe.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointNotFoundError,
    state_digest,
)
from worldpipe.checkpoint.layout import resolve_location
from worldpipe.checkpoint.loadable import step_problems
from worldpipe.models import WorldModel
from worldpipe.models.restore import restore_model
from worldpipe.rollout.padding import probe_batch_invariance

log = logging.getLogger("worldpipe.rollout")


class UnknownModelVersion(LookupError):
    """A request named a model version this server does not hold."""


@dataclass
class ServedModel:
    """One loaded checkpoint: the model in eval mode and what identifies it."""

    version: str
    step: int
    model: WorldModel
    obs_dim: int
    act_dim: int
    identity: dict = field(repr=False)
    pins: int = 0
    batch_invariant: bool = True  # may share a batch with other jobs (see worldpipe.rollout.engine)

    @property
    def frame_shape(self) -> tuple[int, int, int] | None:
        """[H, W, 3] of one observation of a frame model (its flat obs_dim values, channel last); None for states."""
        if self.model.observation_key != "pixels":
            return None
        size = self.model.image_size
        return (size, size, 3)

    def frames(self, obs: torch.Tensor) -> torch.Tensor | None:
        """Imagined flat observations [H, obs_dim] (raw units) as uint8 frames [H, 3, height, width] (channels
        first, as the play page draws them); None for state models."""
        shape = self.frame_shape
        if shape is None:
            return None
        return obs.round().clamp(0, 255).to(torch.uint8).reshape(obs.shape[0], *shape).permute(0, 3, 1, 2)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters and buffers."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def load_served_model(root: Path, step: int, device: str = "cpu", manager: CheckpointManager | None = None
                      ) -> ServedModel:
    """Load and verify (sha256 of every file) checkpoint ``step`` under ``root`` as a servable model.

    ``manager``: the one that just chose ``step`` (its decoded state is reused, not read twice).
    """
    state = (manager or CheckpointManager(root, verify="sha256")).load(step)
    identity = state.get("identity") or {}
    try:
        model_cfg = identity["config"]["model"]
    except (KeyError, TypeError):
        raise ValueError(f"{root}/step-{step:06d}/identity.json: no config.model (how to build the model)") from None
    try:
        model = restore_model(model_cfg, state["model"], identity).to(device)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        # A checkpoint written before manifests recorded tensor shapes can hold a model its identity does not
        # describe: refuse it as damaged, in one line, like any other step that does not load.
        first = str(exc).replace("\n", " ").split(";")[0].split(". ")[0]
        raise CheckpointCorruptError(step, [f"{root}/step-{step:06d}/model.pt: does not load into the model its "
                                            f"identity describes ({first})"]) from exc
    obs_dim, act_dim = model.obs_dim, model.act_dim
    for p in model.parameters():
        p.requires_grad_(False)
    invariant = probe_batch_invariance(model, obs_dim, act_dim)
    if not invariant:
        log.warning("step %d: a row's result depends on its batch position on this machine; serving unbatched", step)
    return ServedModel(state_digest(state), step, model, obs_dim, act_dim, identity, batch_invariant=invariant)


class ModelRegistry:
    """The models a server holds: the newest loadable checkpoint of a directory plus versions still pinned."""

    def __init__(self, checkpoint_path: str | Path, device: str = "cpu") -> None:
        root, self.fixed_step = resolve_location(checkpoint_path)  # a run, its checkpoints/ or one step
        self.root = Path(root).resolve()  # pinned to the run `latest` names now, whatever `latest` names later
        self.device = device
        self._lock = threading.Lock()
        self._models: dict[str, ServedModel] = {}
        self._latest: ServedModel | None = None
        self._manager = CheckpointManager(self.root, verify="sha256")
        self._seen: tuple[int, ...] | None = None  # the step directories at the last refresh

    def refresh(self) -> bool:
        """Load the newest loadable step if it is not the one served; True when the served version changed.

        The choice is the one training and ``worldpipe ckpt digest`` make (:mod:`worldpipe.checkpoint.loadable`),
        made again only when the set of step directories changed, so a bad newer step is reported once.
        """
        if self._latest is None and not self.root.is_dir():
            raise CheckpointNotFoundError(f"{self.root}: no such checkpoint directory")
        seen = tuple(sorted(self._manager.store.step_names()))
        if self._latest is not None and seen == self._seen:
            return False
        step = self._choose()
        self._seen = seen
        if step is None or (self._latest is not None and self._latest.step == step):
            return False
        served = load_served_model(self.root, step, self.device, self._manager)
        with self._lock:
            previous = self._latest
            self._models.setdefault(served.version, served)
            self._latest = self._models[served.version]
            self._drop_unpinned()
        changed = previous is None or previous.version != self._latest.version
        if changed:
            log.info("serving %s step %d, model version %s", self.root, step, served.version)
        return changed

    def _choose(self) -> int | None:
        """The step to serve: the fixed one if it loads, else the newest loadable; raises when none at start."""
        if self.fixed_step is not None:
            problems, _ = step_problems(self._manager, self.fixed_step)
            if problems:
                raise CheckpointCorruptError(self.fixed_step, problems)
            return self.fixed_step
        step = self._manager.latest_loadable()
        if step is None and self._latest is None:
            what = "no loadable checkpoint" if self._manager.store.step_names() else "no checkpoint (no step-NNNNNN)"
            raise CheckpointNotFoundError(f"{what} in {self.root}")
        return step

    def _drop_unpinned(self) -> None:
        for version in [v for v, m in self._models.items() if m.pins == 0 and m is not self._latest]:
            del self._models[version]

    def latest(self) -> ServedModel:
        """The model new requests get by default."""
        if self._latest is None:
            raise CheckpointNotFoundError(f"no loadable checkpoint in {self.root}")
        return self._latest

    def get(self, version: str | None) -> ServedModel:
        """The model of ``version`` (None: the latest); raises UnknownModelVersion."""
        if version is None:
            return self.latest()
        with self._lock:
            served = self._models.get(version)
        if served is None:
            raise UnknownModelVersion(f"model version {version!r} is not served here (latest is {self.latest().version})")
        return served

    def pin(self, served: ServedModel) -> None:
        """Keep ``served`` loaded (a session uses it)."""
        with self._lock:
            served.pins += 1

    def unpin(self, served: ServedModel) -> None:
        """Release one :meth:`pin`; an unpinned old version is dropped now."""
        with self._lock:
            served.pins -= 1
            self._drop_unpinned()

    def loaded(self) -> list[ServedModel]:
        """Every model held right now."""
        with self._lock:
            return list(self._models.values())

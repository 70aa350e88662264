"""Loading a checkpoint into a model and optimizer of any layout and world size (resharding).

Every rank reads only the regions its own tensors cover: for a ``DTensor`` the region its placement says
(e.g. FSDP2's row block), for a plain tensor the whole tensor. The regions are cut from the saved pieces
(:mod:`.shards`; shard files are memory-mapped on POSIX stores, so a rank touches only the bytes it needs), or
from the whole tensors of a checkpoint saved unsharded. So a checkpoint saved by N ranks in one layout loads on M
ranks in another: fsdp 4→2, 2→1, 1→4, fsdp↔ddp.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import layout, shards
from .codec import decode_state
from .errors import CheckpointCorruptError, load_error_line
from .manifest import check_sizes

# The state keys that are never sharded (read whole by every rank).
OTHER_KEYS = {layout.SCHEDULER, layout.SCALER, layout.PROGRESS, layout.SAMPLER, layout.RNG, layout.IDENTITY}


class StepFiles:
    """The files of one published step, opened lazily and cached (memory-mapped where possible)."""

    def __init__(self, manager, step: int, manifest: Mapping, map_location: Any = "cpu", mmap: bool = True) -> None:
        self.manager, self.step, self.manifest = manager, step, manifest
        self.map_location, self.mmap = map_location, mmap
        self.contents = manifest["contents"]
        self._opened: dict[str, Any] = {}

    @functools.cached_property
    def index(self) -> dict | None:
        """The parsed shard index (None: an unsharded step)."""
        sharded = self.contents.get(shards.CONTENTS_KEY)
        return self.read_json(sharded["index"]) if sharded else None

    def _where(self, relpath: str) -> str:
        return f"{layout.step_dir_name(self.step)}/{relpath}"

    def load(self, relpath: str, on_cpu: bool = True) -> Any:
        """A tensor file (``weights_only``) on CPU or ``map_location``, memory-mapped on POSIX stores (``mmap``)."""
        if relpath not in self._opened:
            device = "cpu" if on_cpu else self.map_location
            try:
                self._opened[relpath] = self.manager.store.load_torch(self.step, relpath, device, mmap=self.mmap)
            except Exception as exc:  # a damaged file that passed a size-only check
                raise CheckpointCorruptError(self.step, [f"{self._where(relpath)}: cannot load ({load_error_line(exc)})"]) from exc
        return self._opened[relpath]

    def read_json(self, relpath: str) -> Any:
        """A JSON file of the step."""
        try:
            with self.manager.store.open_file(self.step, relpath) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointCorruptError(self.step, [f"{self._where(relpath)}: cannot load ({load_error_line(exc)})"]) from exc

    def other_keys(self) -> dict:
        """The state with only the keys that are never sharded (:data:`OTHER_KEYS`) loaded."""
        return decode_state(self.contents, self.load, self.read_json, OTHER_KEYS)

    def skeleton(self, key: str) -> Any:
        """The stored tree of ``key`` (placeholders not resolved), or None when absent."""
        relpath = self.contents.get(key)
        return self.load(relpath) if relpath else None

    def region(self, saved: Any, name: str, offset: list[int], shape: list[int]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of the saved logical tensor ``saved`` (placeholder or tensor)."""
        if shards.is_placeholder(saved):
            if self.index is None:
                raise CheckpointCorruptError(self.step, [f"{name}: placeholder in an unsharded checkpoint"])
            entry = self.index["tensors"][shards.placeholder_id(saved, self.index)]
            try:
                return shards.read_region(entry, offset, shape, self.load)
            except (ValueError, KeyError) as exc:
                raise CheckpointCorruptError(self.step, [f"{self._where(shards.INDEX_FILE)}: {name}: {exc}"]) from exc
        if not isinstance(saved, torch.Tensor):
            raise CheckpointCorruptError(self.step, [f"{name}: expected a tensor, found {type(saved).__name__}"])
        return saved[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))].clone()

    def global_shape(self, saved: Any) -> list[int]:
        """Logical shape of a saved tensor or placeholder."""
        if shards.is_placeholder(saved) and self.index is not None:
            return list(self.index["tensors"][shards.placeholder_id(saved, self.index)]["shape"])
        return list(saved.shape) if isinstance(saved, torch.Tensor) else []


def open_step(manager, step: int) -> StepFiles:
    """Manifest and size checks of the files this rank will read; raises CheckpointCorruptError naming them."""
    manifest, problems = manager._manifest(step)
    if manifest is not None:  # else problems say why
        problems = check_sizes(manifest, step, lambda p: manager.store.size_of(step, p))
    if problems:
        raise CheckpointCorruptError(step, problems)
    return StepFiles(manager, step, manifest)


def _fill(source: StepFiles, saved: Any, target: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor laid out like ``target`` holding the saved values."""
    if list(target.shape) != source.global_shape(saved):
        raise CheckpointCorruptError(source.step, [f"{name}: saved shape {source.global_shape(saved)} != "
                                                   f"{list(target.shape)} in the model being loaded"])
    if shards.is_dtensor(target):
        from torch.distributed.tensor import DTensor

        offset, shape = shards.placement_of(target)
        local = source.region(saved, name, offset, shape).to(target.device)
        return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    return source.region(saved, name, [0] * target.dim(), list(target.shape)).to(target.device)


def _fill_tree(source: StepFiles, saved: Any, target: Any, path: list) -> Any:
    """``saved`` with its tensors laid out like their counterparts in ``target`` (same paths)."""
    name = "/".join(map(str, path))
    if shards.is_placeholder(saved) or isinstance(saved, torch.Tensor):
        if not isinstance(target, torch.Tensor):
            # No counterpart (e.g. a state the optimizer creates lazily): load the whole tensor.
            shape = source.global_shape(saved)
            return source.region(saved, name, [0] * len(shape), shape)
        return _fill(source, saved, target, name)
    if isinstance(saved, Mapping):
        sub = target if isinstance(target, Mapping) else {}
        return {k: _fill_tree(source, v, sub.get(k), [*path, k]) for k, v in saved.items()}
    if isinstance(saved, list | tuple):
        sub = target if isinstance(target, list | tuple) and len(target) == len(saved) else [None] * len(saved)
        return type(saved)(_fill_tree(source, v, t, [*path, i]) for i, (v, t) in enumerate(zip(saved, sub,
                                                                                                strict=True)))
    return saved


def load_resharded(manager, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load checkpoint ``step`` into ``model`` (and ``optimizer``) as they are laid out now; call on every rank.

    Works for sharded and unsharded checkpoints alike, whatever layout and world size wrote them. Files are
    size-checked here; full SHA-256 verification is the caller's choice (e.g. rank 0's ``latest_intact``).
    Returns the other parts of the state (scheduler, scaler, progress, sampler, rng, identity; model and
    optimizer None), as :meth:`CheckpointManager.load` would.
    """
    from torch.distributed.checkpoint import state_dict as dcp

    from worldpipe.parallel.wrap import unwrap  # imports torch's FSDP: a second of start-up

    source = open_step(manager, step)
    module = unwrap(model)
    saved_model = source.skeleton(layout.MODEL) or {}
    target = dcp.get_model_state_dict(module)
    missing = sorted(set(target) - set(saved_model))
    if missing:
        raise CheckpointCorruptError(step, [f"{layout.step_dir_name(step)}/{source.contents[layout.MODEL]}: "
                                            f"no tensor {missing[0]!r} (and {len(missing) - 1} more)"])
    dcp.set_model_state_dict(module, {k: _fill(source, saved_model[k], t, f"model/{k}") for k, t in target.items()})
    if optimizer is not None:
        saved_optim = source.skeleton(layout.OPTIMIZER)
        if saved_optim is None:
            raise CheckpointCorruptError(step, [f"{layout.step_dir_name(step)}: holds no optimizer state"])
        target_optim = dcp.get_optimizer_state_dict(module, optimizer)
        if set(target) < set(saved_model):  # a pipeline stage: only its parameters' optimizer state
            saved_optim = shards.restrict_optimizer(saved_optim, target_optim)
        dcp.set_optimizer_state_dict(module, optimizer, _fill_tree(source, saved_optim, target_optim, ["optimizer"]))
    return source.other_keys()


def lazy_state(manager, step: int) -> dict:
    """Checkpoint ``step`` (verified by the caller) with its sharded tensors as :class:`.shards.LazyTensor` s
    (shards memory-mapped), for :func:`.digest.state_digest`, which then assembles one tensor at a time."""
    source = open_step(manager, step)
    state = source.other_keys()
    for key in shards.SHARDED_STATE_KEYS:
        state[key] = shards.resolve(source.skeleton(key), source.index, source.load, lazy=True)
    return state


def is_sharded(manager, step: int) -> bool:
    """Whether published step ``step`` has shard files (False when its manifest is missing or damaged)."""
    manifest, _ = manager._manifest(step)
    return manifest is not None and bool(manifest["contents"].get(shards.CONTENTS_KEY))

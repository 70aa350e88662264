"""Sharded tensors in a checkpoint: splitting a rank's state into its own pieces, and reading regions back.

A sharded checkpoint holds the usual files (see :mod:`.layout`), written by rank 0, in which every
``DTensor`` leaf of ``model``/``optimizer``/``ema`` is replaced by a placeholder ``{PLACEHOLDER: id}``; plain
tensors stay inline (they are replicated: rank 0's copy is the one stored). Besides them::

    shards/rank-00000.pt     rank 0's local pieces, {key: tensor}, torch.load(weights_only=True)-loadable
    shards/rank-00001.pt     ...one per rank that holds any piece
    shards/index.json        per placeholder id: state path, global shape, dtype, and its pieces
                             (file, key, global offset, shape): together they tile the logical tensor once

Pieces are regions of the logical (unsharded) tensor, so any reader can cut any other region out of them:
that is what makes loading onto another layout or world size possible (see :mod:`.resharding`). Replicated
mesh dimensions are written once (by the replica at coordinate 0). A plain tensor that only some ranks hold
(a pipeline stage's: :class:`OwnedTensor`) is one piece covering the whole tensor, written by one of them.

A model cut into pipeline stages (:func:`join_stages`): each rank's own model and optimizer state dicts (its
stage's tensors, under their full-model names) are joined into the state of the whole model without moving a
tensor: only names, shapes and dtypes are exchanged (one object all-gather). Every rank builds the same joined
tree, with an :class:`OwnedTensor` leaf per tensor, written by the lowest rank that holds it (a stage's
data-parallel replicas hold copies). The optimizer's param groups list every stage's parameter names in stage
order, which is the order of the whole model's parameters (stages are contiguous runs of it): the joined state
is the one a single process saves. Loading cuts the saved state down to the names this rank's stage holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from worldpipe.parallel.runtime import Runtime, gather_objects

from . import layout

PLACEHOLDER = "__worldpipe_shard__"
SHARD_DIR = "shards"
INDEX_FILE = f"{SHARD_DIR}/index.json"
INDEX_FORMAT = 1
SHARDED_STATE_KEYS = (layout.MODEL, layout.OPTIMIZER, layout.EMA)
CONTENTS_KEY = "shards"  # manifest contents: {"index": INDEX_FILE, "files": [...], "world_size": N}


def shard_file(rank: int) -> str:
    """Relative path of rank ``rank``'s shard file."""
    return f"{SHARD_DIR}/rank-{rank:05d}.pt"


def is_dtensor(obj: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed support has no sharded tensors
        return False
    return isinstance(obj, DTensor)


def placement_of(dtensor) -> tuple[list[int], list[int]]:
    """(global offset, local shape) of this rank's local tensor inside the logical tensor."""
    offset, local_shape = _placement(tuple(dtensor.shape), dtensor.device_mesh, tuple(dtensor.placements))
    return list(offset), list(local_shape)


@functools.lru_cache(maxsize=4096)
def _placement(shape: tuple, mesh, placements: tuple) -> tuple[tuple, tuple]:
    # Cached: an async save computes it for every tensor on the training thread's clock, and it never changes.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(offset), tuple(local_shape)


def _writes_piece(dtensor) -> bool:
    # Replicas along a mesh dimension hold the same piece: only coordinate 0 of that dimension writes it.
    mesh = dtensor.device_mesh
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_partial():
            raise ValueError("cannot checkpoint a DTensor with a Partial placement (reduce it first)")
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return False
    return _first_copy_outside(mesh)


@functools.lru_cache(maxsize=64)
def _first_copy_outside(mesh) -> bool:
    # A tensor on a submesh (FSDP over "dp" of a dp×tp mesh, for a module tensor parallelism leaves whole) is
    # replicated along the root mesh's dimensions that the submesh does not span, which its placements do not
    # mention: there only coordinate 0 writes. Decided from ranks, so a flattened submesh needs no names.
    root = mesh._get_root_mesh()
    if root is mesh:
        return True
    coords = [(root.mesh == rank).nonzero()[0].tolist() for rank in mesh.mesh.flatten().tolist()]
    return all(coords[0][dim] == 0 for dim in range(root.ndim) if len({c[dim] for c in coords}) == 1)


@dataclass
class OwnedTensor:
    """A whole tensor that only some ranks hold (a pipeline stage's parameters and optimizer state).

    Every rank puts one at the same path (SPMD); ``tensor`` is None where the rank does not hold it, and
    ``writes`` is True on exactly one rank that does.
    """

    shape: list[int]
    dtype: str
    writes: bool = False
    tensor: torch.Tensor | None = None


@dataclass
class LocalShards:
    """One rank's view of a state being saved sharded."""

    skeleton: dict  # the state with every DTensor leaf replaced by a placeholder (same on every rank)
    tensors: list[dict] = field(default_factory=list)  # per id: path, shape, dtype (same on every rank)
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # key in this rank's file -> local piece
    pieces: dict[int, dict] = field(default_factory=dict)  # id -> this rank's piece (key, offset, shape)


def split_state(state: Mapping) -> LocalShards:
    """Replace the DTensor leaves of ``state`` by placeholders and collect this rank's pieces of them.

    Every rank must call it on a state of the same structure (SPMD): placeholder ids are assigned in
    traversal order, so they agree across ranks without communication.
    """
    shards = LocalShards(skeleton={})
    for key, value in state.items():
        shards.skeleton[key] = _split(value, [key], shards) if key in SHARDED_STATE_KEYS else value
    return shards


def _split(obj: Any, path: list, shards: LocalShards) -> Any:
    if isinstance(obj, OwnedTensor):
        ident = len(shards.tensors)
        shards.tensors.append({"path": path, "shape": list(obj.shape), "dtype": obj.dtype})
        if obj.writes and obj.tensor is not None and obj.tensor.numel():
            key = str(ident)
            shards.local[key] = obj.tensor.detach()
            shards.pieces[ident] = {"key": key, "offset": [0] * len(obj.shape), "shape": list(obj.shape)}
        return {PLACEHOLDER: ident}
    if is_dtensor(obj):
        ident = len(shards.tensors)
        shards.tensors.append({"path": path, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")})
        local = obj.to_local().detach()
        if local.numel() and _writes_piece(obj):
            offset, shape = placement_of(obj)
            if list(local.shape) != shape:
                raise ValueError(f"{'/'.join(map(str, path))}: local shape {list(local.shape)} != {shape} "
                                 "expected from the placement")
            key = str(ident)
            shards.local[key] = local
            shards.pieces[ident] = {"key": key, "offset": offset, "shape": shape}
        return {PLACEHOLDER: ident}
    if isinstance(obj, Mapping):
        return {k: _split(v, [*path, k], shards) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, [*path, i], shards) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_split(v, [*path, i], shards) for i, v in enumerate(obj))
    return obj


def build_index(tensors: list[dict], pieces_by_rank: list[dict[int, dict]]) -> dict:
    """The ``shards/index.json`` body from every rank's pieces (index = rank); checks they tile each tensor."""
    entries = [{**meta, "pieces": [{"file": shard_file(rank), **pieces[ident]}
                                   for rank, pieces in enumerate(pieces_by_rank) if ident in pieces]}
               for ident, meta in enumerate(tensors)]
    index = {"format_version": INDEX_FORMAT, "world_size": len(pieces_by_rank), "tensors": entries}
    problems = index_problems(index, {shard_file(rank) for rank in range(len(pieces_by_rank))})
    if problems:
        raise ValueError(problems[0])
    return index


def index_problems(index: Any, shard_files: set[str]) -> list[str]:
    """What keeps ``index`` (a parsed ``shards/index.json``) from describing its tensors exactly once.

    Every piece must name one of ``shard_files`` (the manifest's shard files: confined to the step and
    hash-checked), lie inside its tensor, and the pieces of a tensor must tile it: no overlap, every element.
    """
    if not isinstance(index, Mapping) or index.get("format_version") != INDEX_FORMAT:
        return [f"{INDEX_FILE}: not a format-{INDEX_FORMAT} shard index"]
    if not isinstance(index.get("tensors"), list):
        return [f"{INDEX_FILE}: 'tensors' is not a list"]
    for ident, entry in enumerate(index["tensors"]):
        problem = _entry_problem(entry, shard_files)
        if problem:
            where = "/".join(map(str, entry.get("path") or [ident])) if isinstance(entry, Mapping) else ident
            return [f"{INDEX_FILE}: {where}: {problem}"]
    return []


def _entry_problem(entry: Any, shard_files: set[str]) -> str | None:
    if not (isinstance(entry, Mapping) and isinstance(entry.get("path"), list) and is_shape(entry.get("shape"))
            and isinstance(entry.get("pieces"), list)):
        return "malformed entry"
    try:
        _dtype(str(entry.get("dtype")))
    except ValueError as exc:
        return str(exc).removeprefix(f"{INDEX_FILE}: ")
    shape, boxes = entry["shape"], []
    for piece in entry["pieces"]:
        if not (isinstance(piece, Mapping) and isinstance(piece.get("key"), str) and is_shape(piece.get("offset"))
                and is_shape(piece.get("shape")) and len(piece["offset"]) == len(piece["shape"]) == len(shape)):
            return f"malformed piece {piece!r}"[:200]
        if piece.get("file") not in shard_files:
            return f"piece file {piece.get('file')!r} is not a shard file of this step"
        if any(o + n > size for o, n, size in zip(piece["offset"], piece["shape"], shape, strict=True)):
            return f"piece at {piece['offset']} of shape {piece['shape']} lies outside shape {shape}"
        box = list(zip(piece["offset"], piece["shape"], strict=True))
        if any(_overlap(box, other) for other in boxes):
            return f"pieces overlap at offset {piece['offset']}"
        boxes.append(box)
    covered = sum(math.prod(n for _, n in box) for box in boxes)
    if covered != math.prod(shape):
        return f"pieces cover {covered} of {math.prod(shape)} elements"
    return None


def is_shape(value: Any) -> bool:
    """True for a list of non-negative ints (a shape or an offset as JSON holds it)."""
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    # Two boxes overlap iff their intervals overlap along every axis (an empty box overlaps nothing).
    return all(n > 0 and m > 0 and o < p + m and p < o + n for (o, n), (p, m) in zip(a, b, strict=True))


def is_placeholder(obj: Any) -> bool:
    """True for a placeholder left in the skeleton instead of a sharded tensor."""
    return isinstance(obj, Mapping) and len(obj) == 1 and PLACEHOLDER in obj


def placeholder_id(obj: Mapping, index: Mapping) -> int:
    """The tensor id a placeholder names (validated against ``index``)."""
    ident = obj[PLACEHOLDER]
    if isinstance(ident, bool) or not isinstance(ident, int) or not 0 <= ident < len(index["tensors"]):
        raise ValueError(f"{INDEX_FILE}: no sharded tensor {ident!r}")
    return ident


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{INDEX_FILE}: unknown dtype {name!r}")
    return dtype


def read_region(entry: Mapping, offset: list[int], shape: list[int],
                open_file: Callable[[str], Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """The region ``[offset, offset + shape)`` of the logical tensor ``entry`` describes, cut from its pieces.

    ``open_file(relpath)`` returns a shard file's ``{key: tensor}`` (ideally memory-mapped, so only the
    overlapping bytes are read). Raises ValueError when the pieces do not cover the region.
    """
    out = torch.empty(shape, dtype=_dtype(entry["dtype"]))
    covered = 0
    for piece in entry["pieces"]:
        lo = [max(o, po) for o, po in zip(offset, piece["offset"], strict=True)]
        hi = [min(o + s, po + ps) for o, s, po, ps in zip(offset, shape, piece["offset"], piece["shape"],
                                                           strict=True)]
        if any(h <= l_ for l_, h in zip(lo, hi, strict=True)):
            continue
        source = open_file(piece["file"])[piece["key"]]
        src = source[tuple(slice(l_ - po, h - po) for l_, h, po in zip(lo, hi, piece["offset"], strict=True))]
        dst = out[tuple(slice(l_ - o, h - o) for l_, h, o in zip(lo, hi, offset, strict=True))]
        dst.copy_(src)
        covered += src.numel()
    if covered != math.prod(shape):
        where = "/".join(map(str, entry["path"]))
        raise ValueError(f"{INDEX_FILE}: {where}: shards cover {covered} of {math.prod(shape)} elements")
    return out


class LazyTensor:
    """A logical tensor of a sharded checkpoint, assembled from its pieces only when asked for.

    The state digest materializes these one at a time, so digesting a sharded checkpoint never holds more
    than one whole tensor (plus the memory-mapped pieces) in one process.
    """

    def __init__(self, entry: Mapping, open_file: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
        self.entry, self.open_file = entry, open_file

    def materialize(self) -> torch.Tensor:
        """The whole tensor."""
        return read_region(self.entry, [0] * len(self.entry["shape"]), self.entry["shape"], self.open_file)


def resolve(tree: Any, index: Mapping, open_file: Callable[[str], Mapping[str, torch.Tensor]],
            lazy: bool = False) -> Any:
    """``tree`` with every placeholder replaced by its whole logical tensor (assembled tensor by tensor);
    ``lazy``: by a :class:`LazyTensor` instead."""
    if is_placeholder(tree):
        tensor = LazyTensor(index["tensors"][placeholder_id(tree, index)], open_file)
        return tensor if lazy else tensor.materialize()
    if isinstance(tree, Mapping):
        return {k: resolve(v, index, open_file, lazy) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(resolve(v, index, open_file, lazy) for v in tree)
    return tree


_TENSOR = "__tensor__"


def _outline(tree: Any) -> Any:
    """``tree`` with tensors replaced by (shape, dtype) markers: what the other ranks need to know of it."""
    if isinstance(tree, torch.Tensor):
        return {_TENSOR: (list(tree.shape), str(tree.dtype).removeprefix("torch."))}
    if isinstance(tree, Mapping):
        return {k: _outline(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_outline(v) for v in tree)
    return tree


def _join(outlines: list[Any]) -> Any:
    """One tree holding every rank's entries (dicts: union of keys, in rank order; lists: the first rank's)."""
    present = [o for o in outlines if o is not None]
    first = present[0]
    if isinstance(first, Mapping) and _TENSOR not in first:
        keys = list(dict.fromkeys(k for o in present if isinstance(o, Mapping) for k in o))
        return {k: _join([o.get(k) if isinstance(o, Mapping) else None for o in present]) for k in keys}
    return first


def _holds(outline: Any, path: tuple) -> bool:
    """Whether a rank's outline has a tensor at ``path``."""
    for key in path:
        if not isinstance(outline, Mapping) or _TENSOR in outline or key not in outline:
            return False
        outline = outline[key]
    return isinstance(outline, Mapping) and _TENSOR in outline


def _owned(outline: Any, mine: Any, outlines: list[Any], path: tuple, rank: int) -> Any:
    """The joined outline with an OwnedTensor per tensor: this rank's tensor where it holds one, written by the
    lowest rank that holds it."""
    if isinstance(outline, Mapping) and _TENSOR in outline:
        shape, dtype = outline[_TENSOR]
        held = mine if isinstance(mine, torch.Tensor) else None
        writes = held is not None and not any(_holds(other, path) for other in outlines[:rank])
        return OwnedTensor(shape, dtype, writes=writes, tensor=held)
    if isinstance(outline, Mapping):
        return {k: _owned(v, mine.get(k) if isinstance(mine, Mapping) else None, outlines, path + (k,), rank)
                for k, v in outline.items()}
    return outline


def _param_groups(groups_by_rank: list[list[Mapping]]) -> list[dict]:
    """Each group with the parameter names of every stage, in rank order (= stage order for dp coordinate 0)."""
    return [{**group, "params": list(dict.fromkeys(n for groups in groups_by_rank for n in groups[i]["params"]))}
            for i, group in enumerate(groups_by_rank[0])]


def join_stages(runtime: Runtime, model_state: Mapping, optim_state: Mapping) -> tuple[dict, dict]:
    """This rank's stage state dicts -> the whole model's, with :class:`OwnedTensor` leaves (collective)."""
    outlines = gather_objects(runtime, (_outline(model_state), _outline(optim_state.get("state", {})),
                                        _outline(optim_state.get("param_groups", []))))
    models, states = [o[0] for o in outlines], [o[1] for o in outlines]
    model = _owned(_join(models), model_state, models, (), runtime.rank)
    state = _owned(_join(states), optim_state.get("state", {}), states, (), runtime.rank)
    return model, {"state": state, "param_groups": _param_groups([o[2] for o in outlines])}


def join_shapes(runtime: Runtime, shapes: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Every rank's ``{name: shape}`` of its stage joined: the whole model's (collective)."""
    return {name: shape for part in gather_objects(runtime, dict(shapes)) for name, shape in part.items()}


def restrict_optimizer(saved: Mapping, target: Mapping) -> dict:
    """The saved optimizer state of the whole model cut to the parameters in ``target`` (this rank's stage)."""
    names = set(target.get("state", {})) | {n for g in target.get("param_groups", []) for n in g["params"]}
    groups = [{**group, "params": [n for n in group["params"] if n in names]} for group in saved["param_groups"]]
    return {"state": {k: v for k, v in saved["state"].items() if k in names}, "param_groups": groups}

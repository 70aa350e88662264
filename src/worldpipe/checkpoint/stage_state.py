"""The state of a model cut into pipeline stages: every rank holds some of the tensors, none holds them all.

Saving: each rank's own model and optimizer state dicts (its stage's tensors, under their full-model names)
are joined into the state of the whole model without moving a tensor: only names, shapes and dtypes are
exchanged (one object all-gather). Every rank builds the same joined tree, with an :class:`.shards.OwnedTensor`
leaf per tensor, written by the lowest rank that holds it (a stage's data-parallel replicas hold copies). The
optimizer's param groups list every stage's parameter names in stage order, which is the order of the whole
model's parameters (stages are contiguous runs of it): the joined state is the one a single process saves.

Loading: the saved state of the whole model is cut down to the names this rank's stage holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worldpipe.parallel.runtime import Runtime, gather_objects

from .shards import OwnedTensor

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
    joined = []
    for index, group in enumerate(groups_by_rank[0]):
        names = dict.fromkeys(n for groups in groups_by_rank for n in groups[index]["params"])
        joined.append({**group, "params": list(names)})
    return joined


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
    joined: dict[str, list[int]] = {}
    for part in gather_objects(runtime, dict(shapes)):
        joined.update(part)
    return joined


def restrict_optimizer(saved: Mapping, target: Mapping) -> dict:
    """The saved optimizer state of the whole model cut to the parameters in ``target`` (this rank's stage)."""
    names = set(target.get("state", {})) | {n for g in target.get("param_groups", []) for n in g["params"]}
    groups = [{**group, "params": [n for n in group["params"] if n in names]} for group in saved["param_groups"]]
    return {"state": {k: v for k, v in saved["state"].items() if k in names}, "param_groups": groups}

"""Which tensors a step holds: the table the writer records in its manifest, and checking a step against it.

A checkpoint whose files hash correctly may still not load: a ``model.pt`` re-saved with other shapes and a
re-hashed manifest is self-consistent. So the writer records, in ``MANIFEST.json`` under ``tensors``, every
tensor of the tensor-holding state keys (model, optimizer, scheduler, scaler, EMA) with its path in the state,
logical (unsharded) shape and dtype; a reader compares what it finds against that table, and against the shapes
the model being loaded expects, before it calls the step loadable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from . import layout, shards


class Entry(NamedTuple):
    """One tensor found in a stored state."""

    path: tuple  # its place in the state, starting with the state key
    shape: list[int]  # logical (unsharded) shape
    dtype: str
    indexed: bool  # a sharded tensor: described by the shard index, not stored inline


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling shard indexes use too)."""
    return str(dtype).removeprefix("torch.")


def walk_tensors(tree: Any, path: tuple, sharded: Sequence[Mapping] | None = None) -> Iterator[Entry]:
    """Every tensor leaf of ``tree`` (placeholders of a sharded step: their logical tensor from ``sharded``)."""
    if shards.is_placeholder(tree):
        ident = tree[shards.PLACEHOLDER]
        meta = sharded[ident] if sharded is not None and isinstance(ident, int) and 0 <= ident < len(sharded) else {}
        yield Entry(path, list(meta.get("shape") or []), str(meta.get("dtype")), True)
    elif isinstance(tree, torch.Tensor):
        yield Entry(path, list(tree.shape), dtype_name(tree.dtype), False)
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from walk_tensors(value, (*path, key), sharded)
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from walk_tensors(value, (*path, i), sharded)


def tensor_table(state: Mapping, sharded: Sequence[Mapping] | None = None) -> list[dict]:
    """The manifest's ``tensors`` table of ``state`` (``sharded``: the tensors its placeholders stand for)."""
    return [{"path": list(e.path), "shape": e.shape, "dtype": e.dtype}
            for key in layout.TENSOR_KEYS for e in walk_tensors(state.get(key), (key,), sharded)]


def table_problems(table: object) -> list[str]:
    """What is malformed in a recorded ``tensors`` table (checked when the manifest is parsed)."""
    if not isinstance(table, list):
        return ["'tensors' is not a list"]
    for entry in table:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), list) and entry["path"]
                and isinstance(entry.get("dtype"), str) and shards.is_shape(entry.get("shape"))):
            return [f"malformed 'tensors' entry {entry!r}"[:200]]
    return []


def _name(path: Sequence) -> str:
    return "/".join(map(str, path))


def compare_to_record(found: list[Entry], recorded: list[dict], where: Callable[[Entry | None, tuple], str]
                      ) -> list[str]:
    """Problems of the tensors found in a step against the manifest's record of them (first few named).

    ``where(entry, path)`` names the file a tensor was found in (``entry`` None: it was not found).
    """
    want = {tuple(e["path"]): (list(e["shape"]), e["dtype"]) for e in recorded}
    have = {e.path: e for e in found}
    problems = [f"{where(have[p], p)}: {_name(p[1:])}: shape {have[p].shape} {have[p].dtype} where the manifest "
                f"records {want[p][0]} {want[p][1]}" for p in want if p in have
                and (have[p].shape, have[p].dtype) != want[p]]
    problems += [f"{where(None, p)}: {_name(p[1:])}: recorded in the manifest but not stored" for p in want
                 if p not in have]
    problems += [f"{where(have[p], p)}: {_name(p[1:])}: stored but not recorded in the manifest" for p in have
                 if p not in want]
    return _first(problems)


def compare_to_model(found: list[Entry], expected: Mapping[str, Sequence[int]], where: Callable[[Entry | None, tuple],
                                                                                             str]) -> list[str]:
    """Problems of a step's model tensors against the shapes the model being loaded has (``{name: shape}``)."""
    have = {e.path[1]: e for e in found if e.path[0] == layout.MODEL and len(e.path) == 2}
    problems = [f"{where(have[n], have[n].path)}: {n}: shape {have[n].shape} != {list(shape)} in the model being "
                "loaded" for n, shape in expected.items() if n in have and have[n].shape != list(shape)]
    problems += [f"{where(None, (layout.MODEL, n))}: {n}: missing (the model being loaded has it)" for n in expected
                 if n not in have]
    problems += [f"{where(have[n], have[n].path)}: {n}: not a tensor of the model being loaded" for n in have
                 if n not in expected]
    return _first(problems)


def _first(problems: list[str], limit: int = 3) -> list[str]:
    # One line per step is the report: the first few mismatches name the damage, a count says how much more.
    if len(problems) <= limit:
        return problems
    return [*problems[:limit], f"... and {len(problems) - limit} more mismatches"]

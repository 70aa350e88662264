"""Whether a published step can be loaded, and the newest one that can: the one notion every reader shares.

Training resume, ``worldpipe ckpt verify`` and ``ckpt digest``, the rollout service and evaluation all choose a
step through :func:`newest_loadable`, so they agree on which step is current. A step is loadable when

- its manifest parses and every file it lists has its size and (per the manager's ``verify`` mode) SHA-256;
- every path it names stays inside the step directory (the manifest checks names; stores refuse symlinks that
  lead out, see :meth:`.stores.posix.PosixStore.local_path`; shard pieces must name the manifest's shard files);
- every tensor file loads with ``torch.load(weights_only=True)`` (nothing executes code);
- a sharded step's index tiles every tensor exactly once, and each piece matches its shard's tensor;
- every tensor has the shape and dtype the manifest's ``tensors`` table records, and (when the caller says
  what the model being loaded has) the model's tensors are exactly the expected names and shapes.

Each step skipped is reported on one line, naming the step and why.

A step whose files hash correctly may still not load: a ``model.pt`` re-saved with other shapes and a re-hashed
manifest is self-consistent. So the writer records, in ``MANIFEST.json`` under ``tensors``, every tensor of the
tensor-holding state keys with its path in the state, logical (unsharded) shape and dtype (:func:`tensor_table`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from . import layout, shards
from .errors import CheckpointCorruptError
from .resharding import StepFiles

logger = logging.getLogger("worldpipe.checkpoint")


class Entry(NamedTuple):
    """One tensor found in a stored state."""

    path: tuple  # its place in the state, starting with the state key
    shape: list[int]  # logical (unsharded) shape
    dtype: str
    indexed: bool  # a sharded tensor: described by the shard index, not stored inline
    ident: Any = None  # a sharded tensor's id in the shard index, as its placeholder names it


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling shard indexes use too)."""
    return str(dtype).removeprefix("torch.")


def walk_tensors(tree: Any, path: tuple, sharded: Sequence[Mapping] | None = None) -> Iterator[Entry]:
    """Every tensor leaf of ``tree`` (placeholders of a sharded step: their logical tensor from ``sharded``)."""
    if shards.is_placeholder(tree):
        ident = tree[shards.PLACEHOLDER]
        meta = sharded[ident] if sharded is not None and isinstance(ident, int) and 0 <= ident < len(sharded) else {}
        yield Entry(path, list(meta.get("shape") or []), str(meta.get("dtype")), True, ident)
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
    return [{"path": list(e.path), "shape": e.shape, "dtype": e.dtype} for e in found_tensors(state, sharded=sharded)]


def _name(path: Sequence) -> str:
    return "/".join(map(str, path))


def _first(problems: list[str], limit: int = 3) -> list[str]:
    # One line per step is the report: the first few mismatches name the damage, a count says how much more.
    if len(problems) <= limit:
        return problems
    return [*problems[:limit], f"... and {len(problems) - limit} more mismatches"]


ExpectedShapes = Mapping[str, Sequence[int]]  # model tensor name -> shape the model being loaded has


def found_tensors(state: Mapping, keys: Sequence[str] = layout.TENSOR_KEYS,
                  sharded: Sequence[Mapping] | None = None) -> list[Entry]:
    """(path, shape, dtype) of every tensor of ``state``'s tensor-holding ``keys``."""
    return [entry for key in keys for entry in walk_tensors(state.get(key), (key,), sharded)]


def structure_problems(found: list[Entry], manifest: Mapping, step: int, keys: set[str] | None = None,
                       expected: ExpectedShapes | None = None) -> list[str]:
    """``found`` against the manifest's ``tensors`` table (restricted to ``keys``) and the ``expected`` model
    (``{name: shape}``); the first few mismatches of each are named."""
    name = layout.step_dir_name(step)

    def where(entry: Entry | None, path: tuple) -> str:
        if entry is not None and entry.indexed:
            return f"{name}/{shards.INDEX_FILE}"
        stored = (manifest.get("contents") or {}).get(path[0])
        return f"{name}/{stored}" if isinstance(stored, str) else name

    problems, have = [], {e.path: e for e in found}
    if isinstance(manifest.get("tensors"), list):  # manifests written before the table lack it
        want = {tuple(e["path"]): (list(e["shape"]), e["dtype"]) for e in manifest["tensors"]
                if keys is None or e["path"][0] in keys}
        problems += _first([f"{where(have[p], p)}: {_name(p[1:])}: shape {have[p].shape} {have[p].dtype} where the "
                            f"manifest records {want[p][0]} {want[p][1]}" for p in want if p in have
                            and (have[p].shape, have[p].dtype) != want[p]]
                           + [f"{where(None, p)}: {_name(p[1:])}: recorded in the manifest but not stored"
                              for p in want if p not in have]
                           + [f"{where(have[p], p)}: {_name(p[1:])}: stored but not recorded in the manifest"
                              for p in have if p not in want])
    if expected is not None:  # the model's tensors against the shapes of the model being loaded
        model = {e.path[1]: e for e in found if e.path[0] == layout.MODEL and len(e.path) == 2}
        problems += _first([f"{where(model[n], model[n].path)}: {n}: shape {model[n].shape} != {list(shape)} in the "
                            "model being loaded" for n, shape in expected.items()
                            if n in model and model[n].shape != list(shape)]
                           + [f"{where(None, (layout.MODEL, n))}: {n}: missing (the model being loaded has it)"
                              for n in expected if n not in model]
                           + [f"{where(model[n], model[n].path)}: {n}: not a tensor of the model being loaded"
                              for n in model if n not in expected])
    return problems


def step_problems(manager, step: int, expected: ExpectedShapes | None = None) -> tuple[list[str], dict | None]:
    """Why ``step`` cannot be loaded (``[]``: it can) and, for an unsharded step, its decoded state.

    An unsharded step is decoded whole (on CPU) while it is hashed, so a caller that goes on to load it pays
    no second read; a sharded step's shards are only opened (memory-mapped where the store allows), never
    assembled, so no process ever holds the whole state of a run that never gathers it.
    """
    manifest, problems = manager._manifest(step)
    if manifest is None:
        return problems, None
    if manifest["contents"].get(shards.CONTENTS_KEY):
        return _sharded_problems(manager, step, manifest, expected), None
    state, problems = manager._load_verified(step, "cpu", None)
    if state is None:
        return problems, None
    # The manifest's table was compared in _load_verified (every load does that); here: the model's shapes.
    problems = structure_problems(found_tensors(state), {"contents": manifest["contents"]}, step, expected=expected)
    return problems, (None if problems else state)


def _sharded_problems(manager, step: int, manifest: Mapping, expected: ExpectedShapes | None) -> list[str]:
    problems = manager.verify(step, full=None)
    if problems:
        return problems
    name = layout.step_dir_name(step)
    try:
        source = StepFiles(manager, step, manifest)
        listed = set(manifest["contents"][shards.CONTENTS_KEY].get("files") or [])
        problems = [f"{name}/{p}" for p in shards.index_problems(source.index, listed)]
        if problems:
            return problems
        skeleton = {key: source.skeleton(key) for key in layout.TENSOR_KEYS}  # weights_only, every file
        for relpath in sorted(listed):
            source.load(relpath)
        source.other_keys()
        found = found_tensors(skeleton, sharded=source.index["tensors"])
        seen, count = [e.ident for e in found if e.indexed], len(source.index["tensors"])
        if any(type(i) is not int for i in seen) or sorted(seen) != list(range(count)):  # each tensor named once
            return [f"{name}/{shards.INDEX_FILE}: the state's {len(seen)} placeholders do not name each of its "
                    f"{count} tensors once"]
        # Every piece's key exists in its (weights-only loaded) shard file with the piece's shape and dtype.
        for entry in source.index["tensors"]:
            for piece in entry["pieces"]:
                where = f"{name}/{piece['file']}"
                held = source.load(piece["file"])
                tensor = held.get(piece["key"]) if isinstance(held, Mapping) else None
                if not isinstance(tensor, torch.Tensor):
                    return [f"{where}: no tensor {piece['key']!r} (named by {shards.INDEX_FILE})"]
                if list(tensor.shape) != piece["shape"] or dtype_name(tensor.dtype) != entry["dtype"]:
                    return [f"{where}: tensor {piece['key']!r} is {list(tensor.shape)} {dtype_name(tensor.dtype)}"
                            f", {shards.INDEX_FILE} says {piece['shape']} {entry['dtype']}"]
    except CheckpointCorruptError as exc:
        return exc.problems
    return structure_problems(found, manifest, step, expected=expected)


def newest_loadable(manager, expected: ExpectedShapes | None = None) -> tuple[int | None, dict | None]:
    """The newest loadable step (None when there is none) and, when unsharded, its decoded state.

    Every newer step is skipped with one warning line that names the step and its first problems.
    """
    for step in sorted(manager.store.step_names(), reverse=True):
        problems, state = step_problems(manager, step, expected)
        if not problems:
            return step, state
        logger.warning("skipping checkpoint %s: %s", manager.store.location(step), "; ".join(problems))
    return None, None


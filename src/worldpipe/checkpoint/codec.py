"""Mapping between a state dict and the files of one step directory (see :mod:`.layout` for the names).

Tensor-holding parts go through :mod:`.tensorfile` (``torch.load(weights_only=True)``-compatible, tensor bytes
referenced, not copied); progress, sampler and identity are JSON; RNG is one ``.pt`` per rank plus a readable
JSON view.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import layout, shards
from .state import from_portable, rng_view, to_portable, validate_state
from .tensorfile import Segment, encode, encode_with_fallback


@dataclass
class PendingFile:
    """One file to publish: its path relative to the step directory and its content as segments."""

    relpath: str
    segments: list[Segment]

    @property
    def size(self) -> int:
        """Total bytes."""
        return sum(len(s) if isinstance(s, bytes) else s.nbytes for s in self.segments)


def json_bytes(obj: Any) -> bytes:
    """Canonical, readable JSON encoding (sorted keys; NaN/inf rejected so every reader can parse it)."""
    return (json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def encode_state(state: Mapping, fallback: bool = True) -> tuple[list[PendingFile], dict]:
    """Files for ``state`` and the manifest's ``contents`` table (state key -> relative path(s)).

    Tensor bytes are referenced, never read, unless an object needs ``torch.save``'s fallback; with
    ``fallback=False`` such an object raises :class:`.tensorfile.UnsupportedObject` instead, so a snapshot whose
    copy is still running can be encoded without reading it.
    """
    validate_state(state)
    encoder = encode_with_fallback if fallback else encode
    files: list[PendingFile] = []
    contents: dict[str, Any] = {}
    for key in layout.TENSOR_KEYS:
        contents[key] = layout.TENSOR_FILES[key] if state.get(key) is not None else None
        if contents[key] is not None:
            files.append(PendingFile(contents[key], encoder(state[key], archive=key)))
    train_state = {layout.PROGRESS: dict(state.get(layout.PROGRESS) or {}),
                   layout.SAMPLER: dict(state.get(layout.SAMPLER) or {})}
    files.append(PendingFile(layout.TRAIN_STATE_FILE, [json_bytes(train_state)]))
    contents["train_state"] = layout.TRAIN_STATE_FILE
    files.append(PendingFile(layout.IDENTITY_FILE, [json_bytes(state.get(layout.IDENTITY) or {})]))
    contents[layout.IDENTITY] = layout.IDENTITY_FILE
    for rank, rng in enumerate(state.get(layout.RNG) or []):
        portable = to_portable(dict(rng))
        files.append(PendingFile(layout.rng_file(rank), encoder(portable, archive="rng")))
        files.append(PendingFile(layout.rng_view_file(rank), [json_bytes(rng_view(portable))]))
    contents[layout.RNG] = [layout.rng_file(rank) for rank in range(len(state.get(layout.RNG) or []))]
    return files, contents


def decode_state(contents: Mapping, load_torch: Callable[[str, bool], Any], read_json: Callable[[str], Any],
                 keys: set[str] | None = None) -> dict:
    """Rebuild the state from a step's files.

    ``load_torch(relpath, on_cpu)`` loads a tensor file (``on_cpu`` forces CPU: RNG states must be CPU tensors),
    ``read_json(relpath)`` parses a JSON file. ``keys`` restricts which state keys are loaded; others are None.
    A sharded checkpoint's tensors are assembled whole from its shard files (see :mod:`.shards`).
    """
    wanted = set(layout.STATE_KEYS) if keys is None else set(keys)
    state: dict[str, Any] = dict.fromkeys(layout.STATE_KEYS)
    for key in layout.TENSOR_KEYS:
        if key in wanted and contents.get(key):
            state[key] = load_torch(contents[key], False)
    if wanted & {layout.PROGRESS, layout.SAMPLER}:
        train_state = read_json(contents["train_state"])
        state[layout.PROGRESS] = train_state.get(layout.PROGRESS, {})
        state[layout.SAMPLER] = train_state.get(layout.SAMPLER, {})
    if layout.IDENTITY in wanted:
        state[layout.IDENTITY] = read_json(contents[layout.IDENTITY])
    if layout.RNG in wanted:
        state[layout.RNG] = [from_portable(load_torch(p, True)) for p in contents.get(layout.RNG) or []]
    sharded = contents.get(shards.CONTENTS_KEY)
    if sharded and wanted & set(shards.SHARDED_STATE_KEYS):
        index, open_file = read_json(sharded["index"]), functools.cache(lambda relpath: load_torch(relpath, True))
        for key in shards.SHARDED_STATE_KEYS:
            state[key] = shards.resolve(state[key], index, open_file)
    return state


def files_for_keys(contents: Mapping, keys: set[str] | None) -> set[str] | None:
    """Relative paths :func:`decode_state` reads for ``keys`` (None: all files)."""
    if keys is None:
        return None
    paths = {contents[k] for k in layout.TENSOR_KEYS if k in keys and contents.get(k)}
    if keys & {layout.PROGRESS, layout.SAMPLER}:
        paths.add(contents["train_state"])
    if layout.IDENTITY in keys:
        paths.add(contents[layout.IDENTITY])
    if layout.RNG in keys:
        paths.update(contents.get(layout.RNG) or [])
    sharded = contents.get(shards.CONTENTS_KEY)
    if sharded and keys & set(shards.SHARDED_STATE_KEYS):
        paths.update([sharded["index"], *sharded["files"]])
    return paths

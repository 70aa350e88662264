"""Content digest of a training state, independent of how and by how many ranks it was stored.

``state_digest`` hashes exactly what determines the algorithm's future apart from randomness: model,
optimizer (state and param_groups), scheduler, scaler, EMA, sampler and progress. RNG state (per rank: depends
on the world size) and identity (records, not state) are excluded. Two states have the same digest iff these
parts are equal: tensors bitwise with the same dtype and shape, other leaves as canonical JSON.

Encoding: a self-delimiting, tagged pre-order walk. Dict keys are sorted by their canonical encoding; tuples
and lists are the same sequence (JSON round trips turn one into the other); tensors contribute dtype, shape and
their bytes in C order (so strides, device, ``requires_grad`` and storage sharing do not matter). ``progress``
and ``sampler`` are first normalized through JSON because they are stored as JSON.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping

import numpy as np
import torch

from . import layout
from .shards import LazyTensor

DIGEST_KEYS = (layout.MODEL, layout.OPTIMIZER, layout.SCHEDULER, layout.SCALER, layout.EMA, layout.PROGRESS,
               layout.SAMPLER)
_JSON_NORMALIZED = (layout.PROGRESS, layout.SAMPLER)
_HASH_CHUNK = 64 << 20


def state_digest(state: Mapping) -> str:
    """SHA-256 hex digest of the canonical content of ``state`` (see module docstring)."""
    h = hashlib.sha256(b"worldpipe-state-digest-v1\0")
    for key in DIGEST_KEYS:
        value = state.get(key)
        if key in _JSON_NORMALIZED:
            value = json.loads(json.dumps(value if value is not None else {}, sort_keys=True))
        _feed(h, key)
        _feed(h, value)
    return h.hexdigest()


def _frame(h, tag: bytes, payload: bytes) -> None:
    h.update(tag + len(payload).to_bytes(8, "little") + payload)


def tree_digest(obj) -> str:
    """SHA-256 hex digest of any tree of the kinds a state holds, in :func:`state_digest`'s encoding."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _key_bytes(key) -> bytes:
    # A state's keys repeat from save to save: str and int ones are hashed once per process.
    return _plain_key_bytes(key) if type(key) in (str, int) else bytes.fromhex(tree_digest(key))


@functools.lru_cache(maxsize=8192)
def _plain_key_bytes(key: str | int) -> bytes:
    return bytes.fromhex(tree_digest(key))


@functools.lru_cache(maxsize=8192)
def _tensor_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return json.dumps({"dtype": str(dtype), "shape": list(shape)}, sort_keys=True).encode()


def _feed(h, obj) -> None:
    if obj is None:
        _frame(h, b"N", b"")
    elif isinstance(obj, LazyTensor):  # a sharded checkpoint's tensor: assembled now, dropped after hashing
        _feed(h, obj.materialize())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        _frame(h, b"T", _tensor_header(t.dtype, tuple(t.shape)))
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        h.update(raw.nbytes.to_bytes(8, "little"))
        view = memoryview(raw).cast("B")
        for start in range(0, len(view), _HASH_CHUNK):
            h.update(view[start:start + _HASH_CHUNK])
    elif isinstance(obj, Mapping):
        items = sorted(((_key_bytes(k), v) for k, v in obj.items()), key=lambda kv: kv[0])
        _frame(h, b"D", len(items).to_bytes(8, "little"))
        for kb, v in items:
            h.update(kb)
            _feed(h, v)
    elif isinstance(obj, list | tuple):
        _frame(h, b"L", len(obj).to_bytes(8, "little"))
        for v in obj:
            _feed(h, v)
    elif isinstance(obj, np.ndarray):
        _feed(h, torch.from_numpy(np.ascontiguousarray(obj)))
    elif isinstance(obj, np.generic):
        _feed(h, obj.item())
    elif isinstance(obj, bool | int | float | str):
        nonfinite = isinstance(obj, float) and not math.isfinite(obj)
        _frame(h, b"J", json.dumps(repr(obj) if nonfinite else obj).encode())
    else:
        # dtypes, devices and the like: their string form is their identity.
        _frame(h, b"S", f"{type(obj).__module__}.{type(obj).__qualname__}:{obj}".encode())

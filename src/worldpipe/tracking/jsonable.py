"""Readable, reversible JSON for states that hold tensors, arrays, tuples and big ints (sampler, RNG).

Tensors become ``{"__tensor__": dtype, "shape": [...], "hex": bytes}``, NumPy arrays
``{"__ndarray__": dtype, "shape": [...], "data": [...]}``, tuples ``{"__tuple__": [...]}``, bytes
``{"__bytes__": hex}``. ``from_jsonable(to_jsonable(x))`` equals ``x``: an artifact can be read back.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from worldpipe.core.hashing import only_json_scalars

TENSOR, NDARRAY, TUPLE, BYTES = "__tensor__", "__ndarray__", "__tuple__", "__bytes__"


def to_jsonable(obj: Any) -> Any:
    """JSON-serialisable, readable form of ``obj`` (see module docstring)."""
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported: no import here
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        return {TENSOR: str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": raw.hex()}
    if isinstance(obj, np.ndarray):
        return {NDARRAY: obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes | bytearray):
        return {BYTES: bytes(obj).hex()}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        # Python's RNG state is a tuple of 625 ints: nothing in it to convert, so no call per item.
        items = list(obj) if only_json_scalars(obj) else [to_jsonable(v) for v in obj]
        return {TUPLE: items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def from_jsonable(obj: Any) -> Any:
    """Inverse of :func:`to_jsonable`."""
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    if not isinstance(obj, Mapping):
        return obj
    if TENSOR in obj:
        import torch

        dtype = getattr(torch, obj[TENSOR])
        raw = bytearray.fromhex(obj["hex"])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if NDARRAY in obj:
        return np.asarray(obj["data"], dtype=np.dtype(obj[NDARRAY])).reshape(obj["shape"])
    if TUPLE in obj:
        return tuple(from_jsonable(v) for v in obj[TUPLE])
    if BYTES in obj:
        return bytes.fromhex(obj[BYTES])
    return {k: from_jsonable(v) for k, v in obj.items()}

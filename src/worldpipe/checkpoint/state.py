"""The training-state snapshot: its structure, deep copies of it, and capture/restore of RNG state.

A state is a dict with exactly these keys (see :mod:`worldpipe.checkpoint.layout`)::

    model      dict[str, Tensor]                    parameters and buffers
    optimizer  optimizer.state_dict() | None
    scheduler  lr_scheduler.state_dict() | None     only if the run uses one
    scaler     GradScaler.state_dict() | None       only if the run uses AMP
    ema        dict[str, Tensor] | None             only if the run keeps an EMA
    progress   {"step", "epoch", "samples_seen", "tokens_seen"}: ints
    sampler    JSON-able dict (seed, epoch, cursor into the global order)
    rng        list[dict], index = rank, each as returned by capture_rng()
    identity   JSON-able dict (config, hashes, code version, world size, ...)

A checkpoint holds one RNG file per rank (``rng/rank-NNNNN.pt``). Restoring rank 0's state on every rank, or
losing a rank's file, changes what a resumed run draws without changing the checkpoint digest (which leaves RNG
out by definition). :func:`audit_rng` finds both from the stored files: the files listed are exactly ranks
0..W-1 for the recorded world size, each loads, and the streams training seeds per rank are distinct.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from worldpipe.core.hashing import only_json_scalars

from . import layout
from .digest import tree_digest
from .errors import CheckpointError

_NDARRAY_TAG = "__ndarray__"
# Keys of the process-global streams in a captured RNG state.
PYTHON_STREAM = "python"
NUMPY_GLOBAL_STREAM = "numpy_global"


def validate_state(state: Mapping) -> None:
    """Raise ``ValueError`` if ``state`` does not follow the state contract (unknown/missing keys, bad types)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    unknown = set(state) - set(layout.STATE_KEYS)
    if unknown:
        # Dropping a key silently would lose state the run's future depends on.
        raise ValueError(f"unknown state keys {sorted(unknown)}; known: {list(layout.STATE_KEYS)}")
    if not isinstance(state.get(layout.MODEL), Mapping):
        raise ValueError("state['model'] must be a dict of tensors")
    for key in layout.OPTIONAL_KEYS:
        if state.get(key) is not None and not isinstance(state[key], Mapping):
            raise ValueError(f"state[{key!r}] must be a dict or None")
    for name, value in (state.get(layout.PROGRESS) or {}).items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"state['progress'][{name!r}] must be an int, got {value!r}")
    for key in (layout.PROGRESS, layout.SAMPLER, layout.IDENTITY):
        try:
            json.dumps(state.get(key) or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state[{key!r}] must be JSON-serializable: {exc}") from exc
    rng = state.get(layout.RNG) or []
    if not isinstance(rng, list | tuple) or not all(isinstance(r, Mapping) for r in rng):
        raise ValueError("state['rng'] must be a list of per-rank dicts (index = rank)")


def snapshot_state(state: Mapping, *, reuse: dict | None = None, record: dict | None = None,
                   defer: Callable[[torch.Tensor], bool] | None = None,
                   deferred: list | None = None) -> dict:
    """Deep copy of ``state`` that training may keep mutating: tensors are detached CPU clones.

    Tensors that are the same view of the same storage (tied weights) stay shared in the copy. ``reuse`` and
    ``record`` let a caller recycle buffers between snapshots: ``record`` receives this snapshot's tensors by
    position; passing that dict as ``reuse`` next time copies into those tensors (same shape and dtype) instead
    of allocating. Only pass ``reuse`` once nothing reads the earlier snapshot any more.

    With ``defer``, tensors for which ``defer(tensor)`` is true get their destination only: ``(destination,
    source)`` pairs are appended to ``deferred`` and the caller copies them later (see :mod:`.async_writer`).
    """
    return _copy_tree(state, {}, reuse, record, (), (defer, deferred) if defer is not None else None)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _copy_tree(obj, memo: dict, reuse: dict | None, record: dict | None, path: tuple, defer=None):
    """Copy ``obj`` (see :func:`snapshot_state`). Reusing buffers avoids allocating fresh memory for every
    snapshot, whose page faults can cost more than the copy itself."""
    if isinstance(obj, torch.Tensor):
        key = _tensor_key(obj) if obj.untyped_storage().data_ptr() else None
        if key is not None and key in memo:
            return memo[key]
        src = obj.detach()
        buf = reuse.get(path) if reuse is not None else None
        reusable = (buf is not None and buf.shape == src.shape and buf.dtype == src.dtype
                    and buf.is_contiguous() and src.layout == torch.strided)
        if defer is not None and src.layout == torch.strided and defer[0](src):
            # Allocation is lazy (pages are touched by the copy), so it costs the caller next to nothing.
            out = buf if reusable else torch.empty(src.shape, dtype=src.dtype, device="cpu")
            defer[1].append((out, src))
        elif reusable:
            out = buf.copy_(src)
        else:
            out = src.to("cpu", copy=True) if src.layout == torch.strided else src.cpu().clone()
        if record is not None:
            record[path] = out
        if key is not None:
            memo[key] = out
        return out
    if isinstance(obj, Mapping):
        copied = {k: _copy_tree(v, memo, reuse, record, (*path, k), defer) for k, v in obj.items()}
        # Keep OrderedDict & co. (state_dict() returns OrderedDict); plain dict otherwise.
        return copied if type(obj) is dict else type(obj)(copied)
    if isinstance(obj, list):
        return [_copy_tree(v, memo, reuse, record, (*path, i), defer) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        items = [_copy_tree(v, memo, reuse, record, (*path, i), defer) for i, v in enumerate(obj)]
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    return copy.deepcopy(obj)


def to_portable(obj):
    """Replace numpy arrays/scalars by plain Python so ``torch.load(weights_only=True)`` and JSON accept them."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY_TAG: obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return {k: to_portable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):  # a long run of ints (Python's random state) is copied in one go
        return type(obj)(obj) if only_json_scalars(obj) else type(obj)(to_portable(v) for v in obj)
    return obj


def from_portable(obj):
    """Inverse of :func:`to_portable`."""
    if isinstance(obj, Mapping):
        if _NDARRAY_TAG in obj:
            return np.asarray(obj["data"], dtype=np.dtype(obj[_NDARRAY_TAG])).reshape(obj["shape"])
        return {k: from_portable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(from_portable(v) for v in obj)
    return obj


def capture_rng(torch_generators: Mapping[str, torch.Generator] | None = None) -> dict:
    """This process's RNG state: Python ``random``, NumPy's global generator, torch CPU/CUDA default + named.

    The result holds only Python containers, ints/floats and CPU ``ByteTensor`` s, so it loads with
    ``torch.load(weights_only=True)`` and survives ``all_gather_object``.
    """
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        PYTHON_STREAM: random.getstate(),
        NUMPY_GLOBAL_STREAM: to_portable(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "generators": {name: g.get_state() for name, g in (torch_generators or {}).items()},
    }


def restore_rng(rng: Mapping, torch_generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`capture_rng` captured, in place, into the global and the given named generators.

    A named generator the state does not hold raises ``KeyError``: silently keeping its current state would
    make the resumed run draw different numbers.
    """
    py = rng[PYTHON_STREAM]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if rng.get(NUMPY_GLOBAL_STREAM) is not None:
        np.random.set_state(tuple(from_portable(rng[NUMPY_GLOBAL_STREAM])))
    torch.set_rng_state(_byte_tensor(rng["torch"]))
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in rng["cuda"]])
    saved_torch = rng.get("generators") or {}
    for name, gen in (torch_generators or {}).items():
        if name not in saved_torch:
            raise KeyError(f"RNG state holds no torch generator {name!r} (has {sorted(saved_torch)})")
        gen.set_state(_byte_tensor(saved_torch[name]))


def _byte_tensor(t) -> torch.Tensor:
    # Generator states must be CPU uint8 tensors, whatever map_location the checkpoint was loaded with.
    return torch.as_tensor(t).to(device="cpu", dtype=torch.uint8)


def rng_view(rng: Mapping) -> dict:
    """Readable JSON view of one rank's RNG state (tensors as hex); for people and MLflow, never read back."""

    def view(obj):
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
            return {"dtype": str(obj.dtype), "shape": list(obj.shape), "hex": bytes(flat.numpy()).hex()}
        if isinstance(obj, Mapping):
            return {str(k): view(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return list(obj) if only_json_scalars(obj) else [view(v) for v in obj]
        return obj

    return view(to_portable(rng))


def rng_fingerprint(rng: Mapping) -> dict[str, str]:
    """SHA-256 per stream of one rank's RNG state (as :func:`~worldpipe.checkpoint.state.capture_rng` returns it
    or a checkpoint loads it); named generators appear as ``torch:<name>``.

    Equal fingerprints mean equal states: the representation is normalized (lists vs tuples, portable NumPy
    arrays), so a state captured live and the same state read back from a file agree.
    """
    rng = from_portable(to_portable(dict(rng)))
    streams: dict[str, Any] = {PYTHON_STREAM: rng.get(PYTHON_STREAM), NUMPY_GLOBAL_STREAM: rng.get(NUMPY_GLOBAL_STREAM),
                               "torch": rng.get("torch"), "cuda": rng.get("cuda")}
    streams.update({f"torch:{k}": v for k, v in (rng.get("generators") or {}).items()})
    return {name: tree_digest(state) for name, state in streams.items() if state is not None}


def audit_rng(manifest: Mapping, rng_states: list[Mapping], world_size: int | None,
              per_rank_streams: Sequence[str]) -> list[str]:
    """Problems with a checkpoint's RNG files (``[]`` when fine), each naming the step and file.

    ``manifest``: the step's parsed manifest; ``rng_states``: its RNG states as loaded, index = rank;
    ``world_size``: the world size recorded in the step's identity (None: unknown, not checked);
    ``per_rank_streams``: streams the trainer seeds differently on every rank, so no two ranks may share one.
    """
    step = manifest.get("step")
    where = layout.step_dir_name(step) if isinstance(step, int) else "checkpoint"
    listed = list((manifest.get("contents") or {}).get(layout.RNG) or [])
    expected = [layout.rng_file(rank) for rank in range(len(listed))]
    problems = []
    if not listed:
        return [f"{where}: no RNG files ({layout.RNG_DIR}/)"]
    if listed != expected:
        problems.append(f"{where}: RNG files {listed} are not one per rank in order (expected {expected})")
    if world_size is not None and len(listed) != world_size:
        problems.append(f"{where}: {len(listed)} RNG file(s) for a run of world size {world_size} "
                        f"(identity.json)")
    prints = [rng_fingerprint(state) for state in rng_states]
    for stream in per_rank_streams:
        owner: dict[str, int] = {}
        for rank, fingerprint in enumerate(prints):
            value = fingerprint.get(stream)
            if value is None:
                problems.append(f"{where}/{layout.rng_file(rank)}: no {stream!r} state")
            elif value in owner:
                problems.append(f"{where}/{layout.rng_file(rank)}: {stream!r} state identical to rank "
                                f"{owner[value]}'s (each rank must keep its own stream)")
            else:
                owner[value] = rank
    return problems


def check_rng_files(manager: Any, step: int, per_rank_streams: Sequence[str]) -> list[str]:
    """:func:`audit_rng` of step ``step`` of a :class:`~worldpipe.checkpoint.CheckpointManager`'s store."""
    manifest, problems = manager._manifest(step)
    if manifest is None:
        return problems
    try:
        state = manager.load(step, keys=[layout.RNG, layout.IDENTITY])
    except CheckpointError as exc:
        return [str(exc)]
    world_size = (state[layout.IDENTITY] or {}).get("world_size")
    return audit_rng(manifest, state[layout.RNG] or [], world_size if isinstance(world_size, int) else None,
                     per_rank_streams)

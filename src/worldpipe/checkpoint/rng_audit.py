"""Checks on the per-rank RNG files of a checkpoint, and comparable fingerprints of RNG states.

A checkpoint holds one RNG file per rank (``rng/rank-NNNNN.pt``, see :mod:`worldpipe.checkpoint.layout`).
Restoring rank 0's state on every rank, or losing a rank's file, changes what a resumed run draws without
changing the checkpoint digest (which leaves RNG out by definition). :func:`audit_rng` finds both from the
stored files: the files listed are exactly ranks 0..W-1 for the recorded world size, each loads, and the
streams that training seeds per rank are distinct between ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import layout
from .digest import tree_digest
from .errors import CheckpointError
from .manifest import parse_manifest
from .state import NUMPY_GLOBAL_STREAM, PYTHON_STREAM, from_portable, to_portable


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
    raw = manager.store.read_manifest(step)
    if raw is None:
        return [f"{layout.step_dir_name(step)}/{layout.MANIFEST_NAME}: missing"]
    manifest, problems = parse_manifest(raw, step)
    if manifest is None:
        return problems
    try:
        state = manager.load(step, keys=[layout.RNG, layout.IDENTITY])
    except CheckpointError as exc:
        return [str(exc)]
    world_size = (state[layout.IDENTITY] or {}).get("world_size")
    return audit_rng(manifest, state[layout.RNG] or [], world_size if isinstance(world_size, int) else None,
                     per_rank_streams)

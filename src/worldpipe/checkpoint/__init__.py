"""worldpipe.checkpoint: state capture/restore, atomic durable publication, stores, verification.

The public API (``__all__``: the manager, state snapshots and RNG capture, digests, errors) is imported lazily, so
that reading the layout names in :mod:`.layout` costs nothing. The training-time owner of the state contract is
:class:`worldpipe.checkpoint.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {name: module for module, names in {
    ".digest": ("state_digest",),
    ".errors": ("CheckpointCorruptError", "CheckpointError", "CheckpointNotFoundError", "CheckpointWriteError"),
    ".manager": ("CheckpointInfo", "CheckpointManager", "checkpoint_digest"),
    ".state": ("capture_rng", "restore_rng", "snapshot_state"),
}.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)

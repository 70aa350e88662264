"""worldpipe.checkpoint: state capture/restore, atomic durable publication, stores, verification.

Public API::

    CheckpointManager(root, keep_last=2, keep_every=None, async_save=False, verify="first")
    snapshot_state(state) / capture_rng(...) / restore_rng(...)
    state_digest(state) / checkpoint_digest(root, step=None)
    CheckpointWriteError / CheckpointCorruptError / CheckpointNotFoundError
"""

from .digest import state_digest
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from .manager import CheckpointInfo, CheckpointManager, checkpoint_digest
from .state import capture_rng, restore_rng, snapshot_state

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "capture_rng",
    "checkpoint_digest",
    "restore_rng",
    "snapshot_state",
    "state_digest",
]

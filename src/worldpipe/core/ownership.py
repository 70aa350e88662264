"""Ownership of a run's checkpoints: a process changes what readers see only while it still belongs to its run.

A torchrun worker dies with its launcher (:mod:`worldpipe.launch.lifeline`), but not at the same instant: the
kill travels launcher -> torchrun -> worker, and torchrun takes milliseconds (more on a loaded machine) to die.
A worker caught in a save in that window could still rename a step into place, replace ``latest`` or delete an
old step after its launcher is gone, when the run lock is already free for another run. So every commit point
of a publication (the stores in :mod:`worldpipe.checkpoint.stores`) calls :func:`confirm` first, and a process
whose owner is gone exits there, leaving at most a hidden partial directory that the next writer removes.

The check is registered by whoever knows the owner (the lifeline, in a worker started by `worldpipe train`);
without one, as in tests and in-process runs, every publication proceeds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

# Exit status of a process that found its owner (the launcher) gone: at start-up or at a commit point.
EXIT_ORPHANED = 70

# Returns None while the owner lives, else one line saying what is gone.
OwnerCheck = Callable[[], "str | None"]
_owner_check: OwnerCheck | None = None


def require_owner(check: OwnerCheck | None) -> None:
    """Have every later :func:`confirm` in this process run ``check`` (None: no check)."""
    global _owner_check
    _owner_check = check


def confirm(action: str) -> None:
    """Return if this process may do ``action`` (e.g. "publishing step 40"); else say why and exit at once.

    Exits with :data:`EXIT_ORPHANED` via ``os._exit`` from whichever thread calls it: an orphan has no one to
    report to, and unwinding could run cleanup that touches the run directory.
    """
    check = _owner_check
    if check is None:
        return
    problem = check()
    if problem is None:
        return
    with contextlib.suppress(OSError, ValueError):  # stderr may be a pipe whose reader died with the launcher
        print(f"worldpipe worker {os.getpid()}: {problem}; not {action}", file=sys.stderr, flush=True)
    os._exit(EXIT_ORPHANED)

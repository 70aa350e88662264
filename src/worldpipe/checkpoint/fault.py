"""Fault injection at named phases of publication, driven by ``WORLDPIPE_CKPT_FAULT``.

``WORLDPIPE_CKPT_FAULT="<phase>:<action>"`` with action

* ``die``            SIGKILL this process (what ``kill -9``/preemption/OOM-kill does: no cleanup runs),
* ``pause:<sec>``    sleep, so a test can observe the store mid-publication,
* ``raise``          raise ``OSError(EIO)`` as a failing disk would.

A phase may name the step it applies to, ``<phase>@<step>:<action>`` (e.g. ``after_rename@20:die``), so a
training run can publish earlier checkpoints normally and fail inside a later one. In a multi-rank (sharded)
save, ``#<rank>`` selects the rank the fault applies to, ``<phase>[@<step>]#<rank>:<action>`` (e.g.
``mid_files@4#1:die`` kills rank 1 while it writes its shard of step 4); the rank is the ``RANK`` torchrun sets
(0 without one). Without ``#<rank>`` every process that reaches the phase applies it.
Several faults may be given separated by ``,``. The variable is read at every phase, so a process can change
it between saves. Phases, in publication order, are listed in :data:`PHASES`.

In-process, :func:`hooked` runs a callback at a phase instead: tests synchronise on it (block publication
on an event, observe, release) rather than on a pause of some length.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV_VAR = "WORLDPIPE_CKPT_FAULT"
PHASES = (
    "before_files",  # nothing of the new step exists yet
    "mid_files",  # the first data file is written, the others not
    "after_files",  # all data files written and fsynced, no manifest
    "after_manifest",  # manifest written (POSIX: partial dir complete but not renamed)
    "after_rename",  # step directory published, `latest` still names the previous step
    "after_latest",  # `latest` names the new step
    "before_retention",
    "after_retention",
)


_publishing_step: int | None = None
_hooks: dict[str, Callable[[int | None], None]] = {}


@contextmanager
def publishing(step: int) -> Iterator[None]:
    """Mark the step being published, for faults restricted with ``@<step>``."""
    global _publishing_step
    previous, _publishing_step = _publishing_step, step
    try:
        yield
    finally:
        _publishing_step = previous


@contextmanager
def hooked(phase: str, callback: Callable[[int | None], None]) -> Iterator[None]:
    """While active, call ``callback(step)`` in whichever thread of this process reaches ``phase``."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
    _hooks[phase] = callback
    try:
        yield
    finally:
        _hooks.pop(phase, None)


def inject(phase: str) -> None:
    """Run the hook and apply any fault configured for ``phase``."""
    hook = _hooks.get(phase)
    if hook is not None:
        hook(_publishing_step)
    spec = os.environ.get(ENV_VAR, "")
    if not spec:
        return
    for item in spec.split(","):
        name, _, action = item.strip().partition(":")
        name, _, only_rank = name.partition("#")
        name, _, only_step = name.partition("@")
        if name not in PHASES:
            raise ValueError(f"{ENV_VAR}: unknown phase {name!r} (known: {', '.join(PHASES)})")
        if name != phase or (only_step and int(only_step) != _publishing_step):
            continue
        # The launcher's rank, not the process group's: faults fire before and after the group exists.
        if only_rank and int(only_rank) != int(os.environ.get("RANK", "0")):
            continue
        if action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous; never continue past this point
        elif action.startswith("pause:"):
            time.sleep(float(action.split(":", 1)[1]))
        elif action == "raise":
            raise OSError(errno.EIO, f"injected fault {ENV_VAR}={item.strip()}")
        else:
            raise ValueError(f"{ENV_VAR}: unknown action {action!r} in {item!r}")

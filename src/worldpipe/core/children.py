"""Child processes that die with the process that started them.

A process killed outright (``kill -9``, the OOM killer, a harness's timeout) runs no cleanup, so the children it
was waiting for would run on, orphaned: a benchmark's training runs, a served model, torchrun under the
launcher. Each child therefore asks the kernel, between ``fork`` and ``exec``, for a signal when its parent
dies (``PR_SET_PDEATHSIG``); :func:`run_child` and :func:`start_child` are ``subprocess.run`` and
``subprocess.Popen`` with that request.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1
# Resolved once at import, in the parent: a preexec_fn must not dlopen in a freshly forked child.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent (thread) exits. Linux only; else no-op.

    Safe in a ``preexec_fn``: the setting survives ``exec`` of a non-setuid program.
    """
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")


def run_child(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` for a child that is killed if this process dies first.

    The kernel signals the child when the *thread* that started it ends: call it from the thread that waits.
    """
    return subprocess.run(cmd, preexec_fn=die_with_parent, **kwargs)  # noqa: PLW1509 - it only calls prctl


def start_child(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` for a child that is killed if this process (its starting thread) dies."""
    return subprocess.Popen(cmd, preexec_fn=die_with_parent, **kwargs)  # noqa: PLW1509 - it only calls prctl

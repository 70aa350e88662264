"""Process-wide worker threads that survive between saves and are forgotten, not shared, by a forked child.

Background threads (an async save's publication: its writer, hashing and fsync threads) run at the lowest CPU
priority: hashing and writing a checkpoint then takes only CPU time the training step leaves unused, instead
of slowing the steps it overlaps (docs/architecture.md, "Publication protocol": the protocol is unchanged,
only who yields the CPU). Threads stay threads, so nothing outlives a killed training process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

# Linux nice value of background threads: the weakest CFS weight (15 against 1024 for a normal thread), so a
# training thread sharing a core with one keeps ~98% of it. Unprivileged threads cannot raise it back, which is
# why background work has threads of its own and never borrows the training process's normal ones.
BACKGROUND_NICE = 19

_role = threading.local()


def enter_background() -> None:
    """Make the calling thread a background thread: lowest CPU priority, and :func:`shared_pool` hands it the
    background-priority executors.

    Only on Linux, where a priority set on a thread id is that thread's alone (elsewhere it would lower the
    whole process, the training thread included).
    """
    _role.background = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # a sandbox refusing setpriority costs speed, never correctness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


@functools.cache
def _executor(name: str, max_workers: int, background: bool) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name,
                              initializer=enter_background if background else None)


def shared_pool(name: str, max_workers: int) -> ThreadPoolExecutor:
    """The process's executor ``name``, made on first use and kept; asked from a background thread (an async
    save's publication), its background-priority twin.

    Kept alive because starting a thread waits until it runs, which on a busy machine costs the caller
    milliseconds per save. A forked child (a DataLoader worker, a test's subprocess) inherits the executors but
    none of their threads, so it must start its own: every executor is forgotten after a fork.
    """
    background = getattr(_role, "background", False)  # set by enter_background
    return _executor(f"{name}-bg" if background else name, max_workers, background)


os.register_at_fork(after_in_child=_executor.cache_clear)

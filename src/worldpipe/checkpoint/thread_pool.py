"""Process-wide worker threads that survive between saves and are forgotten, not shared, by a forked child.

Background threads (an async save's publication: its writer, hashing and fsync threads) run at the lowest CPU
priority: hashing and writing a checkpoint then takes only CPU time the training step leaves unused, instead
of slowing the steps it overlaps (docs/architecture.md, "Publication protocol": the protocol is unchanged,
only who yields the CPU). Threads stay threads, so nothing outlives a killed training process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_pools: weakref.WeakSet[LazyThreadPool] = weakref.WeakSet()

# Linux nice value of background threads: the weakest CFS weight (15 against 1024 for a normal thread), so a
# training thread sharing a core with one keeps ~98% of it. Unprivileged threads cannot raise it back, which is
# why background work has threads of its own and never borrows the training process's normal ones.
BACKGROUND_NICE = 19

_role = threading.local()


def enter_background() -> None:
    """Make the calling thread a background thread: lowest CPU priority, and :func:`in_background` is True.

    Only on Linux, where a priority set on a thread id is that thread's alone (elsewhere it would lower the
    whole process, the training thread included).
    """
    _role.background = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # a sandbox refusing setpriority costs speed, never correctness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def in_background() -> bool:
    """True on a thread that :func:`enter_background` made a background thread."""
    return getattr(_role, "background", False)


def background_executor(thread_name_prefix: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread runs at background priority (an async save's publication)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix, initializer=enter_background)


class LazyThreadPool:
    """A ``ThreadPoolExecutor`` made on first use and kept for the life of the process.

    With ``background`` its threads run at background priority (:func:`enter_background`).

    Kept alive because starting a thread waits until it runs, which on a busy machine costs the caller
    milliseconds per save. A forked child (a DataLoader worker, a test's subprocess) inherits the executor
    object but none of its threads, so it must start its own: every pool forgets its executor after a fork.
    """

    def __init__(self, thread_name_prefix: str, max_workers: int | Callable[[], int], background: bool = False) -> None:
        self._prefix = thread_name_prefix
        self._initializer = enter_background if background else None
        self._max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _pools.add(self)

    def get(self) -> ThreadPoolExecutor:
        """The executor, created on the first call in this process."""
        with self._lock:
            if self._executor is None:
                workers = self._max_workers() if callable(self._max_workers) else self._max_workers
                self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self._prefix,
                                                    initializer=self._initializer)
            return self._executor

    def _forget(self) -> None:
        self._executor = None
        self._lock = threading.Lock()  # a lock held by a parent thread at fork time would never be released


def _forget_all_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_forget_all_in_child)

"""Process-wide worker threads that survive between saves and are forgotten, not shared, by a forked child."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_pools: weakref.WeakSet[LazyThreadPool] = weakref.WeakSet()


class LazyThreadPool:
    """A ``ThreadPoolExecutor`` made on first use and kept for the life of the process.

    Kept alive because starting a thread waits until it runs, which on a busy machine costs the caller
    milliseconds per save. A forked child (a DataLoader worker, a test's subprocess) inherits the executor
    object but none of its threads, so it must start its own: every pool forgets its executor after a fork.
    """

    def __init__(self, thread_name_prefix: str, max_workers: int | Callable[[], int]) -> None:
        self._prefix = thread_name_prefix
        self._max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _pools.add(self)

    def get(self) -> ThreadPoolExecutor:
        """The executor, created on the first call in this process."""
        with self._lock:
            if self._executor is None:
                workers = self._max_workers() if callable(self._max_workers) else self._max_workers
                self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self._prefix)
            return self._executor

    def _forget(self) -> None:
        self._executor = None
        self._lock = threading.Lock()  # a lock held by a parent thread at fork time would never be released


def _forget_all_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


os.register_at_fork(after_in_child=_forget_all_in_child)

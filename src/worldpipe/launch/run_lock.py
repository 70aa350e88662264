"""The run-level lock: one training run per run directory, held by the launcher for the run's whole life.

An exclusive ``flock`` on ``RUN_DIR/.run.lock``. The kernel releases it when the holding process dies, however
it dies, so a lock left by a dead process is simply taken over; the file's content (host, pid, start time) only
serves to name the holder in the refusal. The workers never touch it: the launcher outlives them (see
:mod:`worldpipe.launch.lifeline`).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from worldpipe.core.atomic import makedirs_durably
from worldpipe.core.errors import UserError

LOCK_NAME = ".run.lock"


class RunLocked(UserError):
    """Another live process holds the run directory's lock."""


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} (since {info.get('since', '?')})"
    except (ValueError, KeyError, TypeError):
        return "another process (holder unknown)"


class RunLock:
    """Exclusive lock on a run directory: ``acquire()`` refuses at once; released by ``release()`` or death."""

    def __init__(self, run_dir: str | os.PathLike, what: str = "run directory") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.what = what  # how a refusal names the locked directory
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock now or raise RunLocked naming the holder's host and pid."""
        # The run directory is born here: a power cut must not lose it (and the checkpoints made in it) by its name.
        makedirs_durably(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise RunLocked(f"{self.what} {self.path.parent} is in use by {holder}; wait for it to end or "
                            f"stop it (lock file {self.path})") from None
        except BaseException:
            os.close(fd)
            raise
        since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return self

    def ensure_free(self) -> None:
        """Raise RunLocked naming the holder when a live process holds the lock; take nothing (nor write)."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # compatible only with other probes, never a holder
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            raise RunLocked(f"{self.what} {self.path.parent} is in use by {holder}; wait for it to end or "
                            f"stop it (lock file {self.path})") from None
        finally:
            os.close(fd)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a process opening it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

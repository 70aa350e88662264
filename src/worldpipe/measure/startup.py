"""Start-up trace: named timestamps written by the processes themselves, enabled by an environment variable.

With ``WORLDPIPE_STARTUP_TRACE=FILE`` every :func:`mark` appends one JSON line (event, wall-clock time, pid,
rank, and the process's own start time) to FILE; without it :func:`mark` does nothing. ``worldpipe bench
startup`` reads the lines back into a breakdown of the time from ``worldpipe train`` to the first step.
"""

from __future__ import annotations

import json
import os
import time

TRACE_ENV = "WORLDPIPE_STARTUP_TRACE"


_started: dict[int, float | None] = {}  # pid -> its start time: read once per process (a fork gets its own)


def _process_start() -> float | None:
    pid = os.getpid()
    if pid not in _started:
        try:
            import psutil

            _started[pid] = psutil.Process(pid).create_time()
        except Exception:  # psutil missing or /proc unreadable: the event times are still valid
            _started[pid] = None
    return _started[pid]


def mark(event: str, **fields) -> None:
    """Append ``event`` with the current time (and any JSON ``fields``) to the trace file, if tracing is enabled."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), "rank": os.environ.get("RANK"),
                       "process_start": _process_start(), **fields})
    # One short O_APPEND write per line: lines of concurrent processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)

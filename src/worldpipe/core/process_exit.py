"""Ending a finished process without the interpreter's teardown of every module.

A process that has imported torch spends about half a second in ``Py_Finalize`` after its work is done
(destroying thousands of modules and torch's C++ statics): measured 2.9 s -> 2.4 s for importing the trainer and
exiting. A launch is three such processes in a row (worker, torchrun, launcher), so every `worldpipe train`
would wait for it three times. :func:`exit_now` does what ``Py_Finalize`` does that anyone can observe, in the
same order (wait for non-daemon threads and their exit hooks, run ``atexit`` handlers, flush the standard
streams) and then ``os._exit``, as :mod:`multiprocessing` ends its children.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def exit_code(status: object) -> int:
    """The exit status ``sys.exit(status)`` would give (None is 0; anything else not an int is printed, 1)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    print(status, file=sys.stderr)
    return 1


def exit_now(status: object = 0) -> None:
    """End this process with ``status`` (as ``sys.exit`` would), after its threads, atexit handlers and flushes.

    Only for the end of a process's main function, on its main thread: nothing runs after this.
    """
    code = exit_code(status)
    # What Py_Finalize does first: join non-daemon threads and run threading's exit hooks (executors' shutdown).
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or failing: nothing more to say
            stream.flush()
    os._exit(code)

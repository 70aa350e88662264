"""Ending a finished process: the interpreter's own exit, without its final collections over every object.

What a process that imported torch spends in its exit after its work is done goes mostly to the interpreter's
last garbage collections and the teardown of what they free: torch's modules alone hold about a million
objects. :func:`exit_process` moves everything alive at that point out of the collector's reach
(``gc.freeze``) and exits as ``sys.exit`` does, so the interpreter still joins non-daemon threads, runs the
``atexit`` handlers (executors' shutdown, logging's flush) and flushes the standard streams, in its own order;
what is still alive is released with the process, as its memory is (Python never promised ``__del__`` for
objects alive at exit).
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(status: object = 0) -> NoReturn:
    """End this process with ``status`` as ``sys.exit(status)`` does, without the collections over the objects
    alive now. Only for the end of a process's main function, on its main thread."""
    gc.freeze()
    sys.exit(status)

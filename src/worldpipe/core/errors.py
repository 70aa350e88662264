"""Errors a user can cause or meet, as one line: classification, formatting, and where tracebacks go.

An error of a known kind (config, data, checkpoint, disk, run lock) ends as one line on stderr
(``error: <what>, naming the file/key/step``) and a non-zero exit status; its full traceback is appended to the
run's log file (``RUN_DIR/errors.log``), never printed, unless ``--debug`` or ``WORLDPIPE_DEBUG=1``. Anything
else is a bug: it is still one line on stderr, pointing at the log file that holds the traceback.

Under torchrun every rank runs :func:`run_worker_main`. A rank's error is *secondary* when it only says that
another rank went away (gloo's "Connection closed by peer" and friends): it is logged, and printed with the
``SECONDARY_PREFIX`` that the launcher shows only when no rank reported a primary error.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from worldpipe.core.last_words import LastWordsPage

ERROR_PREFIX = "error: "
SECONDARY_PREFIX = "error (secondary): "
ERROR_LOG = "errors.log"
DEBUG_ENV = "WORLDPIPE_DEBUG"

# The exit statuses of every `worldpipe` command, one convention (docs/troubleshooting.md#exit-statuses); an error
# class says which of them it ends with (``exit_code``), and :func:`classify` is the one place that maps errors.
EXIT_OK = 0
EXIT_FAILURE = 1  # a check that ran and failed ("differs", a damaged file), or work that failed on the way
EXIT_USAGE = 2  # bad input or usage: a command line, an argument, a file it names or a config value to change
EXIT_EQUIVALENT = 3  # not bit-identical, but equivalent within the stated tolerance on another numerics environment

# Text of errors that only report that a peer rank (or the rendezvous store) went away.
_SECONDARY_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "Connection refused", "Socket Timeout", "NCCL communicator was aborted",
                      "connection to the store", "Timed out waiting for recv")
# OSError numbers that are the machine's or the user's to fix (a full or failing disk, permissions, paths).
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
# Of those, a path named that is not there (or not of its kind): the input must change.
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}


class UserError(Exception):
    """Base of errors whose message alone tells the user what to fix (it names the file, key or step); they end
    with :data:`EXIT_FAILURE` (work that failed: a full disk, a damaged file), or their class's ``exit_code``.

    Every room derives its own errors from this class (or :class:`UsageError`), so this base layer can classify
    them without importing the rooms above it.
    """

    exit_code = EXIT_FAILURE


class UsageError(UserError):
    """A command line, argument, override or config value that cannot work: refused before any work starts."""

    exit_code = EXIT_USAGE


def debug_enabled() -> bool:
    """True when tracebacks should be shown (``WORLDPIPE_DEBUG=1``, also set by ``worldpipe --debug``)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _usage_types() -> tuple[type, ...]:
    # Imported here, not at the top: this module is imported by every entry point, Hydra only by some.
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (HydraException, OmegaConfBaseException)


def is_secondary(err: BaseException) -> bool:
    """True for an error that only says another rank or the rendezvous store went away."""
    text = str(err)
    return type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError") or any(
        marker in text for marker in _SECONDARY_MARKERS)


def classify(err: BaseException) -> int | None:
    """Exit status for an error a user can cause or meet; None for a bug."""
    if isinstance(err, UserError):
        return err.exit_code
    if isinstance(err, _usage_types()):
        return EXIT_USAGE
    if isinstance(err, OSError) and err.errno in _USER_ERRNOS:
        return EXIT_USAGE if err.errno in _PATH_ERRNOS else EXIT_FAILURE
    return None


def one_line(err: BaseException) -> str:
    """The error's message on one line (multi-line messages joined with '; ')."""
    lines = [" ".join(line.split()) for line in str(err).splitlines()]
    text = "; ".join(line for line in lines if line)
    return text or type(err).__name__


def describe(err: BaseException, log_file: Path | None) -> tuple[str, int]:
    """(line to print, exit status) for ``err``; a bug's line names its type and the log with the traceback."""
    code = classify(err)
    if code is not None:
        return ERROR_PREFIX + one_line(err), code
    where = f"; traceback in {log_file}" if log_file is not None else "; rerun with --debug for the traceback"
    return f"{ERROR_PREFIX}unexpected {type(err).__name__}: {one_line(err)}{where}", EXIT_FAILURE


def append_traceback(log_file: Path | None, err: BaseException, who: str) -> None:
    """Append ``err``'s full traceback to ``log_file`` (best effort: a failing disk must not hide the error)."""
    if log_file is None:
        return
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    text = "".join(traceback.format_exception(err))
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(f"--- {stamp} {who} on {socket.gethostname()} pid {os.getpid()}\n{text}\n")
    except OSError:
        pass


def report(err: BaseException, log_file: Path | None, who: str = "worldpipe", prefix: str | None = None,
           start_line: bool = False) -> int:
    """Log the traceback, print one line on stderr (the traceback too in debug mode); returns the exit status.

    ``start_line`` prefixes the line with a carriage return (a worker's stderr may hold a progress bar).
    """
    append_traceback(log_file, err, who)
    line, code = report_line(err, log_file, prefix)
    if debug_enabled():
        traceback.print_exception(err, file=sys.stderr)
    # "\r" first: a progress bar leaves its line unterminated, and the error must start a line of its own.
    print(("\r" if start_line else "") + line, file=sys.stderr, flush=True)
    return code


def report_line(err: BaseException, log_file: Path | None, prefix: str | None = None) -> tuple[str, int]:
    """The line :func:`report` prints for ``err`` (``prefix`` replacing ``error: ``), and the exit status."""
    line, code = describe(err, log_file)
    return (line if prefix is None else prefix + line.removeprefix(ERROR_PREFIX)), code


def run_worker_main(body: Callable[[], object], log_file: Callable[[], Path | None]) -> None:
    """Run a torchrun worker's body; any error ends as one line (secondary ones marked) and a non-zero exit.

    ``log_file()`` is asked only after a failure (the run directory may not exist before). The line is also left
    as the rank's last words (:mod:`worldpipe.core.last_words`), which the launcher reads when stderr failed.
    """
    last_words = LastWordsPage()
    try:
        body()
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - every error must end as one line, not a traceback
        if isinstance(err, KeyboardInterrupt):
            raise
        rank = os.environ.get("RANK", "0")
        secondary = is_secondary(err) and classify(err) is None
        prefix = SECONDARY_PREFIX if secondary else None
        path = log_file()
        line, code = report_line(err, path, prefix)
        last_words.record(line)
        try:
            report(err, path, who=f"rank {rank}", prefix=prefix, start_line=True)
        except OSError:
            # stderr itself fails (the same failing disk, an injected EIO): the launcher reads the last words.
            _silence_stderr()
        raise SystemExit(code) from None


def _silence_stderr() -> None:
    # A failing stderr would make the interpreter's exit print its own multi-line complaint (via C stdio,
    # which bypasses the failure) while flushing it; point it at /dev/null instead.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives until the process exits
    except OSError:
        pass

"""Lifeline: training processes die with the `worldpipe train` launcher that started them.

torchrun starts every worker in a session of its own, so a signal to the launcher's process group (Ctrl-\\, a
harness or Snakemake killing the job, a crash) never reaches the workers. Each link of the chain therefore asks
the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``): torchrun when the launcher dies, each worker
when torchrun dies. A worker also checks, after arming that signal, that its parent is still the launcher's
torchrun: a parent that died before the signal was armed would otherwise go unnoticed. The same check guards
every commit point of a checkpoint publication (:mod:`worldpipe.core.ownership`): the signal takes a moment to
travel down the chain, and a dying run must not publish in it.
"""

from __future__ import annotations

import os
import signal
import sys

from worldpipe.core.children import die_with_parent
from worldpipe.core.ownership import EXIT_ORPHANED, require_owner

# Set by the launcher in torchrun's environment (and so in every worker's): the pid the chain must lead to.
LAUNCHER_PID_ENV = "WORLDPIPE_LAUNCHER_PID"


def parent_pid_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc (None when it no longer exists)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 4, after the command name in parentheses (which may itself hold spaces or parentheses).
    return int(stat.rsplit(")", 1)[1].split()[1])


def bind_worker_to_launcher() -> None:
    """In a torchrun worker started by `worldpipe train`: die with torchrun; exit now if the chain is broken.

    The chain is worker -> torchrun -> launcher (``$WORLDPIPE_LAUNCHER_PID``), checked now and again before
    each commit point of a publication. Without that variable (torchrun started by hand) nothing is checked.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    die_with_parent(signal.SIGKILL)
    # Armed first, checked second: a parent that dies after this check sends the signal, one that died before
    # it has been replaced by a reaper whose parent is not the launcher.
    torchrun = os.getppid()
    if parent_pid_of(torchrun) != int(launcher):
        print(f"worldpipe worker {os.getpid()}: launcher {launcher} is gone; exiting", file=sys.stderr)
        os._exit(EXIT_ORPHANED)
    require_owner(lambda: chain_problem(torchrun, int(launcher)))


def chain_problem(torchrun: int, launcher: int) -> str | None:
    """None while this process is still torchrun's child and torchrun still the launcher's; else what is gone.

    The launcher's death reparents torchrun before anyone can reap the launcher, so once a caller has seen the
    launcher exit, this check fails in every worker of it.
    """
    if os.getppid() != torchrun:
        return f"torchrun {torchrun} is gone"
    if parent_pid_of(torchrun) != launcher:
        return f"launcher {launcher} is gone"
    return None


def launcher_environment() -> dict[str, str]:
    """Environment for torchrun: this process's, plus the launcher pid the workers check."""
    return {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}

"""torchrun as a fork of the launcher: its start-up without a second import of torch.

By the time the launcher starts torchrun it has imported torch (the config's model check needs the model classes).
A fresh ``python -m worldpipe.launch.torchrun`` imports it again, about 1.6 s on this machine before the first
worker can start. A fork of the launcher already holds it: the child sets up what ``Popen`` would have given the
new process (stderr on the relay's pipe, the environment, the lifeline, the signal dispositions of a fresh
interpreter) and runs the same :func:`worldpipe.launch.torchrun.main` on the same arguments.

A fork copies only the forking thread, and a lock another thread held at that moment stays held in the child
forever, so :func:`start_torchrun` forks only while this process runs no other Python thread, and only when the
command is this interpreter running :mod:`worldpipe.launch.torchrun`; otherwise it starts the command with
``Popen``, as before. Native thread pools are their libraries' business: numpy's OpenBLAS starts one at import
and stops it around every fork (``pthread_atfork``); torch's OpenMP pool starts only on a parallel operator,
which the launcher never runs, and the child computes nothing. The workers are started by torchrun itself, as
fresh processes, either way; a launcher that dies before the child has armed its lifeline is caught by the
workers' own check of the chain (:func:`worldpipe.launch.lifeline.bind_worker_to_launcher`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import IO

from worldpipe.core.process_exit import exit_now
from worldpipe.launch.lifeline import die_with_parent
from worldpipe.launch.torchrun import main as torchrun_main

TORCHRUN_MODULE = torchrun_main.__module__
# WORLDPIPE_TORCHRUN_START=exec: always a fresh interpreter (the path every other platform takes).
START_ENV = "WORLDPIPE_TORCHRUN_START"


def can_fork(cmd: Sequence[str]) -> bool:
    """True when ``cmd`` is this interpreter running worldpipe's torchrun and a fork of this process is safe."""
    ours = len(cmd) > 2 and cmd[0] == sys.executable and list(cmd[1:3]) == ["-m", TORCHRUN_MODULE]
    return (ours and sys.platform.startswith("linux") and os.environ.get(START_ENV, "fork") == "fork"
            and threading.active_count() == 1)


class ForkedProcess:
    """The parts of ``subprocess.Popen`` the launcher uses, for a forked child (pid, stderr pipe, signals)."""

    def __init__(self, pid: int, stderr: IO[bytes]) -> None:
        self.pid, self.stderr = pid, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_torchrun(cmd: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedProcess:
    """Start ``cmd`` (a :func:`worldpipe.launch.torchrun.torchrun_argv` line) with its stderr on a pipe, tied to
    this process by the lifeline; forked when :func:`can_fork`, else as a fresh process."""
    if not can_fork(cmd):
        return subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env,
                                preexec_fn=die_with_parent)  # noqa: PLW1509 - no threads run here yet
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write what this process had buffered a second time
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _run_child(cmd[3:], env, write_end)
    os.close(write_end)
    return ForkedProcess(pid, os.fdopen(read_end, "rb", buffering=0))


def _run_child(args: list[str], env: dict[str, str], stderr_fd: int) -> None:
    """Become torchrun: what Popen and a fresh interpreter would have set up, then torchrun's main."""
    code: object = 1
    try:
        atexit._clear()  # the launcher's exit handlers are the launcher's, not run at torchrun's exit
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        die_with_parent()
        # A fresh interpreter's handlers; SIGUSR1 stays ignored as the launcher set it (see the launcher).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [TORCHRUN_MODULE, *args]
        torchrun_main()
        code = 0
    except SystemExit as done:
        code = done.code
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh interpreter: traceback, 1
        traceback.print_exc()
    finally:
        exit_now(code)

"""Case 2 of issue 9, the mechanism: the run lock refuses at once naming the holder, and a dead holder's lock
is taken over (the holder is a real process, killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from worldpipe.launch.run_lock import RunLock, RunLocked

pytestmark = pytest.mark.adversarial

HOLDER = ("import sys, time; from worldpipe.launch.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
          "print('held', flush=True); time.sleep(600)")


def test_live_holder_is_named_and_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked) as refused:
            RunLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message and str(tmp_path) in message
        assert "\n" not in message
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    with RunLock(tmp_path) as lock:  # the stale file still names the dead pid; the lock itself is free
        assert f'"pid": {os.getpid()}' in lock.path.read_text()
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()  # a second open file description in the same process is refused too
    RunLock(tmp_path).acquire().release()

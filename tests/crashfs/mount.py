"""Mounting the crash-simulating file system for a test: start its server, talk to it, cut its power, unmount.

:class:`CrashMount` starts ``python -m crashfs.server`` on a fresh mount point, waits for its ``ready`` line (the
kernel's INIT reached it), and stops it by PID. ``unavailable()`` says in one line why FUSE cannot be used here
(``make system-deps`` installs Debian's fuse3; mfusepy is a test dependency).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
from multiprocessing.connection import Client
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def unavailable() -> str | None:
    """Why the crash-simulating file system cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "crashfs needs FUSE: no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return "crashfs needs FUSE: no fusermount3 (install Debian's fuse3: make system-deps)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"crashfs needs mfusepy and libfuse3 ({exc}): make install; make system-deps"
    return None


class CrashMount:
    """One mount of the crash-simulating file system over ``workdir/backing`` at ``workdir/mnt``."""

    def __init__(self, workdir: Path, cut_after: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.backing, self.path = self.workdir / "backing", self.workdir / "mnt"
        self.state, self.control = self.workdir / "state", str(self.workdir / "control.sock")
        self.cut_after = cut_after
        self.process: subprocess.Popen | None = None
        self._conn = None

    def __enter__(self) -> CrashMount:
        return self.mount()

    def __exit__(self, *exc_info) -> None:
        self.unmount()

    def mount(self) -> CrashMount:
        """Start the server and wait until the kernel has mounted it."""
        for path in (self.path, self.backing, self.state):
            path.mkdir(parents=True, exist_ok=True)
        for stale in (self.state / "cut", Path(self.control)):
            stale.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "crashfs.server", "--backing", str(self.backing), "--mount", str(self.path),
                "--state", str(self.state), "--control", self.control]
        if self.cut_after is not None:
            argv += ["--cut-after", str(self.cut_after)]
        env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        with open(self.workdir / "server.log", "ab") as log:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            self.stop_server()
            log = (self.workdir / "server.log").read_text(errors="replace").strip().splitlines()
            raise RuntimeError(f"crashfs did not mount at {self.path}: {log[-1] if log else 'no output'}")
        return self

    def request(self, *message) -> object:
        """Send one control request to the server; its answer."""
        if self._conn is None:
            self._conn = Client(self.control, family="AF_UNIX")
        self._conn.send(message)
        return self._conn.recv()

    def faults(self, **faults) -> None:
        """Arm faults (``space``: bytes left before ENOSPC; ``eio_fsync``/``eio_match``: the n-th file fsync
        whose path contains the text fails with EIO)."""
        self.request("faults", faults)

    def recording(self) -> dict:
        """The initial image and the log of every operation since the mount."""
        return self.request("recording")

    def points(self) -> int:
        """Persistence points (file and directory fsyncs) since the mount."""
        return self.request("points")

    def length(self) -> int:
        """Operations logged so far: a crash state at or after this index happened after what returned before."""
        return self.request("length")

    def cut(self) -> int:
        """Cut the power now: only what is durable stays on the backing directory; every later operation
        fails with EIO. Returns the persistence points passed."""
        return self.request("cut")

    @property
    def was_cut(self) -> bool:
        """Whether the power was cut (by :meth:`cut` or ``cut_after``)."""
        return (self.state / "cut").exists()

    def saved_recording(self) -> dict:
        """The recording the server wrote at its unmount or cut."""
        return pickle.loads((self.state / "recording.pickle").read_bytes())

    def unmount(self) -> None:
        """Unmount (lazily if still busy) and stop the server by PID."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.process is None:
            return
        if self.process.poll() is None:
            done = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True)
            if done.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        self.stop_server()

    def stop_server(self) -> None:
        """Wait for the server to end after its unmount; kill it by PID if it does not."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

"""A `worldpipe serve` process for the closed loop over HTTP: started on a free loopback port, stopped by PID.

The server dies with this process too (``PR_SET_PDEATHSIG``), so a killed evaluation leaves no server behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from worldpipe.control.dynamics import ControlError
from worldpipe.core.children import die_with_parent

START_TIMEOUT_S = 180.0


@contextmanager
def served_model(checkpoints: str) -> Iterator[str]:
    """Serve ``checkpoints`` (its newest loadable step) for the duration of the block; yields the base URL."""
    with tempfile.TemporaryDirectory(prefix="worldpipe-control-serve-") as tmp:
        port_file, log_path = Path(tmp) / "port", Path(tmp) / "serve.log"
        command = [sys.executable, "-m", "worldpipe.cli", "serve", checkpoints, "--port", "0",
                   "--port-file", str(port_file), "--threads", "1"]
        with open(log_path, "wb") as log:
            server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
                                      preexec_fn=die_with_parent)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not port_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                    raise ControlError(f"worldpipe serve {checkpoints} did not start: {tail[0]}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{int(port_file.read_text())}"
        finally:
            _stop(server)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.kill(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)

"""A real `worldpipe serve` process on 127.0.0.1 for tests: started on a free port, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import requests

START_TIMEOUT_S = 120


class ServerProcess:
    """`worldpipe serve CHECKPOINT_DIR --port 0 ...` as a subprocess; ``url`` once it listens."""

    def __init__(self, checkpoint_dir: Path, workdir: Path, env: dict, *args: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = workdir / "port"
        self.port_file.unlink(missing_ok=True)
        self.log = workdir / "server.log"
        cmd = ["worldpipe", "serve", str(checkpoint_dir), "--port", "0", "--port-file", str(self.port_file), *args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, body: dict, token: str | None = None) -> requests.Response:
        headers = {"X-Session-Token": token} if token else {}
        return requests.post(self.url + path, json=body, headers=headers, timeout=120)

    def delete(self, path: str, token: str | None = None) -> requests.Response:
        headers = {"X-Session-Token": token} if token else {}
        return requests.delete(self.url + path, headers=headers, timeout=60)

    def terminate(self) -> None:
        """SIGTERM (graceful: in-flight requests finish)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within 60 s; returns the exit status."""
        self.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

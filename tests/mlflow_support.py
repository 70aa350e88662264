"""A real `mlflow server` on 127.0.0.1 for tests, and smoke training runs that record to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """`mlflow server --workers 1` with a SQLite backend and proxied artifacts under `root`."""

    def __init__(self, root: Path, port: int | None = None, backend_uri: str | None = None):
        self.root = Path(root)
        self.backend_uri = backend_uri  # None: SQLite under root, served by `mlflow server` directly
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120.0) -> MlflowServer:
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        self.starts += 1
        log = open(self.root / f"server-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the process
        if self.backend_uri is None:
            command = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers",
                       "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        else:  # as users start it for a cluster
            command = [str(BIN / "worldpipe"), "tracking", "server", "--port", str(self.port),
                       "--backend-store-uri", self.backend_uri]
        self.proc = subprocess.Popen(
            [*command, "--artifacts-destination", str(self.root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / f'server-{self.starts}.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"mlflow server did not answer on {self.url} within {timeout} s")

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


def run_group(cmd: list[str], env: dict, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """subprocess.run in a process group of its own, killed whole (by the group's PID) if the caller is
    interrupted or times out: a pipeline's jobs do not outlive the test."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def train_command(run_dir: Path, dataset: tuple[Path, Path], uri: str, *extra: str) -> list[str]:
    store, manifest = dataset
    return [str(BIN / "worldpipe"), "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", f"tracking.uri={uri}", "trainer.progress_bar=false", *extra]

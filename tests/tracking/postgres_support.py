"""A real PostgreSQL for tests: a fresh cluster in a temp dir on a free port, run as the `postgres` user.

Needs root (to act as `postgres`) and Debian's `postgresql` package (`make system-deps` installs it); the
server is stopped by the PID in its postmaster.pid, and its directory removed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from mlflow_support import free_port

DATABASE = "mlflow"


def postgres_bindir() -> Path | None:
    """Directory of initdb/pg_ctl: Debian's versioned one (newest), else PATH; None if not installed."""
    versioned = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if versioned:
        return Path(versioned[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def unavailable_reason() -> str | None:
    """Why a PostgreSQL cluster cannot be started here (None: it can)."""
    if postgres_bindir() is None:
        return "PostgreSQL is not installed (make system-deps installs Debian's postgresql)"
    if os.geteuid() != 0:
        return "starting PostgreSQL as the postgres user needs root"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "there is no postgres user"
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class PostgresCluster:
    """initdb + pg_ctl start on 127.0.0.1:<free port>, one database; stop() by PID."""

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="worldpipe-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.pid: int | None = None
        self.uri = f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def _as_postgres(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = ["runuser", "-u", "postgres", "--", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        return proc

    def start(self) -> PostgresCluster:
        user = pwd.getpwnam("postgres")
        os.chown(self.root, user.pw_uid, user.pw_gid)
        self._as_postgres(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                          "--no-sync", "-E", "UTF8")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options,
                          "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        self.pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
        self._as_postgres(str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                          DATABASE)
        return self

    def stop(self, timeout: float = 60) -> None:
        """Fast shutdown by PID (SIGINT), SIGKILL if it lingers; then remove the cluster."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and _alive(self.pid):
                    time.sleep(0.2)
                if _alive(self.pid):
                    os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)

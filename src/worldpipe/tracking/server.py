"""`worldpipe tracking server`: an MLflow tracking server for many writers (a cluster's jobs).

SQLite's locking does not work on network filesystems, so a cluster's jobs must not share ``results/mlflow.db``;
they talk HTTP to one server whose backend store is PostgreSQL and whose artifact root is on the shared
filesystem (artifacts are proxied through the server, so jobs need no direct access to it). The server binds
127.0.0.1 unless told otherwise: it has no authentication.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from worldpipe.core.errors import UsageError

LOCAL_HOST = "127.0.0.1"
DEFAULT_PORT = 5000
DATABASE_SCHEMES = ("postgresql", "postgresql+psycopg2", "sqlite", "mysql", "mssql")


class ServerConfigError(UsageError, ValueError):
    """A server option that cannot work; the message names the option."""


def check_backend(uri: str) -> None:
    """A database URI MLflow can use as a backend store, with its driver importable."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in DATABASE_SCHEMES:
        raise ServerConfigError(f"--backend-store-uri {uri!r}: expected a database URI "
                                "(postgresql://USER:PASSWORD@HOST:PORT/DB, or sqlite:///PATH on one machine)")
    if scheme.startswith("postgresql"):
        try:
            import psycopg2  # noqa: F401 - the driver SQLAlchemy loads for postgresql://
        except ImportError as err:
            raise ServerConfigError(f"--backend-store-uri {uri!r}: the PostgreSQL driver psycopg2 is not "
                                    "installed (pip install psycopg2-binary)") from err


def server_command(backend: str, artifacts: str, host: str = LOCAL_HOST, port: int = DEFAULT_PORT,
                   workers: int = 1, extra: list[str] | None = None) -> list[str]:
    """The `mlflow server` command line: proxied artifacts under ``artifacts``, job execution off."""
    check_backend(backend)
    if not 0 < port < 65536:
        raise ServerConfigError(f"--port {port}: not a TCP port")
    if workers < 1:
        raise ServerConfigError(f"--workers {workers}: must be >= 1")
    if "://" not in artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        artifacts = str(Path(artifacts).resolve())
    # This interpreter's MLflow (the venv's), whatever `mlflow` PATH finds.
    return [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers",
            str(workers), "--backend-store-uri", backend, "--artifacts-destination", artifacts, *(extra or [])]


def exec_server(command: list[str]) -> None:
    """Replace this process with the server (signals and exit status are then the server's own)."""
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execv(command[0], command)

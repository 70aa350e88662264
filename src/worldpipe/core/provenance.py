"""Where a run's code came from: code version, package versions, lock file, machine (recorded with every run)."""

from __future__ import annotations

import hashlib
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import worldpipe

PROJECT_ROOT = Path(__file__).resolve().parents[3]
LOCK_FILE = PROJECT_ROOT / "requirements.lock"
TRACKED_PACKAGES = ("torch", "numpy", "zarr", "gymnasium", "hydra-core", "mlflow", "snakemake")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def code_version() -> dict[str, object]:
    """Git SHA and dirty flag of the source tree (None outside a git checkout)."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "worldpipe": worldpipe.__version__,
        "git_sha": sha.strip() if sha else None,
        "git_dirty": bool(status.strip()) if status is not None else None,
    }


def git_diff() -> str:
    """Uncommitted changes to tracked files ('' when clean or not a checkout)."""
    return _git("diff", "HEAD") or ""


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide the numbers, plus Python."""
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def lock_hash() -> str | None:
    """SHA-256 of requirements.lock, the file the install used."""
    return hashlib.sha256(LOCK_FILE.read_bytes()).hexdigest() if LOCK_FILE.exists() else None


def host() -> str:
    """Hostname of this process."""
    return socket.gethostname()

"""Locations: a local path (plain or ``file://``) or an fsspec URL (``s3://``, ``memory://`` ...).

Decided here once: which locations are local, how a local one is made absolute for the records, and how the
bytes of either kind are read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec


def local_path(url: str) -> str | None:
    """The filesystem path for a local location (plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url:
        return None
    return url


def is_local(location: str) -> bool:
    """True for a plain path or a ``file://`` URL."""
    return local_path(str(location)) is not None


def recorded_form(location: str) -> str:
    """How a location is recorded: a local one as an absolute path, a URL as given."""
    path = local_path(str(location))
    return str(Path(path).resolve()) if path is not None else str(location)


def resolve_against(location: str, cwd: str | None) -> str:
    """A recorded relative local path, resolved against the directory it was recorded from."""
    path = local_path(str(location))
    if path is None or Path(path).is_absolute() or not cwd:
        return location
    return str(Path(cwd) / path)


def scheme(location: str) -> str:
    """The URL scheme of a location ('local' for a plain path or ``file://``)."""
    return "local" if is_local(location) else str(location).split("://", 1)[0]


def read_bytes(location: str) -> bytes:
    """The bytes of one file at a local path or fsspec URL (raises OSError when it cannot be read)."""
    path = local_path(str(location))
    if path is not None:
        return Path(path).read_bytes()
    with fsspec.open(location, "rb") as handle:
        return handle.read()


def open_filesystem(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """A synchronous fsspec filesystem and the root path inside it for ``url``."""
    path = local_path(url)
    if path is not None:
        return fsspec.filesystem("file"), os.path.abspath(path)
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, root.rstrip("/")


def list_files(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, int]:
    """Map every file under ``root`` (path relative to root, '/'-separated) to its size in bytes."""
    if not fs.exists(root):
        return {}
    found = fs.find(root, detail=True)
    prefix = root.rstrip("/") + "/"
    files: dict[str, int] = {}
    for full, info in found.items():
        if info.get("type", "file") != "file":
            continue
        rel = full[len(prefix) :] if full.startswith(prefix) else full.lstrip("/")
        files[rel] = int(info["size"])
    return dict(sorted(files.items()))

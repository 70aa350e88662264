"""Turn a dataset location (local path or fsspec URL) into a zarr store or an fsspec filesystem."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore


def local_path(url: str) -> str | None:
    """The filesystem path for a local location (plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url:
        return None
    return url


def open_zarr_store(url: str, *, read_only: bool, storage_options: dict[str, Any] | None = None) -> Store:
    """A zarr store rooted at ``url``.

    Local paths use zarr's LocalStore, whose writes go through a temp file + rename, so a killed writer
    never leaves a half-written shard under its final name. Everything else goes through fsspec
    (``memory://``, ``s3://`` ...); ``storage_options`` are passed to the filesystem (e.g. an S3 endpoint).
    """
    path = local_path(url)
    if path is not None:
        if read_only and not os.path.isdir(path):
            raise FileNotFoundError(f"no trajectory store at {url!r}")
        return LocalStore(os.path.abspath(path), read_only=read_only)
    return FsspecStore.from_url(url, storage_options=dict(storage_options or {}), read_only=read_only)


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

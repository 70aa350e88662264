"""Checkpoint stores: the interface (:mod:`.base`), a POSIX directory (:mod:`.posix`), an object store (:mod:`.object`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.core.locations import local_path

from .base import Store
from .object import ObjectStore
from .posix import PosixStore


def open_store(root: str | Any, storage_options: Mapping | None = None) -> Store:
    """POSIX store for local paths (and ``file://``), object store for any other fsspec URL."""
    path = local_path(str(root))
    return PosixStore(path) if path is not None else ObjectStore(str(root), storage_options)


__all__ = ["ObjectStore", "PosixStore", "Store", "open_store"]

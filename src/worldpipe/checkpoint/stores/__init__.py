"""Checkpoint stores: the interface (:mod:`.base`), a POSIX directory (:mod:`.posix`), an object store (:mod:`.object`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Store
from .object import ObjectStore
from .posix import PosixStore


def open_store(root: str | Any, storage_options: Mapping | None = None) -> Store:
    """POSIX store for local paths (and ``file://``), object store for any other fsspec URL."""
    text = str(root)
    if "://" not in text:
        return PosixStore(text)
    if text.startswith("file://"):
        return PosixStore(text[len("file://"):])
    return ObjectStore(text, storage_options)


__all__ = ["ObjectStore", "PosixStore", "Store", "open_store"]

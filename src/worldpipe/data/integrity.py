"""Read-time integrity checks: a zarr store wrapper that refuses bytes not matching the manifest."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.storage import WrapperStore

from worldpipe.core.errors import UserError

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype


class CorruptShardError(UserError, RuntimeError):
    """A store file's bytes do not match the manifest (or it is missing). ``path`` names the file."""

    def __init__(self, path: str, reason: str = "sha256 mismatch", key: str | None = None) -> None:
        super().__init__(f"corrupt dataset file {path!r}: {reason}")
        self.path = path
        self.key = key if key is not None else path
        self.reason = reason


def sha256_bytes(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class VerifyingStore(WrapperStore[Store]):
    """Wraps a store so every read of a manifest-listed key is checked against its sha256 first.

    zarr's sharding codec reads shard indexes and single chunks with byte-range requests, which cannot be
    hashed on their own; so the first access to a listed key fetches the whole file, verifies it, and
    serves ranges from the verified copy. A small LRU of verified files avoids refetching a shard for
    the index + chunk reads of one selection.
    """

    def __init__(self, store: Store, expected: dict[str, dict], location: str = "", keep: int = 16) -> None:
        super().__init__(store)
        self._expected = expected
        self._location = location.rstrip("/")
        self._keep = keep
        self._verified: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def _with_store(self, store: Store) -> VerifyingStore:
        return type(self)(store, self._expected, self._location, self._keep)

    def _error(self, key: str, reason: str) -> CorruptShardError:
        path = f"{self._location}/{key}" if self._location else key
        return CorruptShardError(path, reason, key=key)

    async def _verified_bytes(self, key: str, prototype: BufferPrototype, keep: bool) -> bytes:
        with self._lock:
            cached = self._verified.get(key)
            if cached is not None:
                self._verified.move_to_end(key)
                return cached
        buf = await self._store.get(key, prototype)
        if buf is None:
            raise self._error(key, "file listed in the manifest is missing")
        data = buf.to_bytes()
        entry = self._expected[key]
        if len(data) != entry["size"]:
            raise self._error(key, f"size {len(data)} != manifest size {entry['size']}")
        if sha256_bytes(data) != entry["sha256"]:
            raise self._error(key, "sha256 does not match the manifest")
        if keep:
            with self._lock:
                self._verified[key] = data
                while len(self._verified) > self._keep:
                    self._verified.popitem(last=False)
        return data

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """Like ``Store.get`` but verified against the manifest for listed keys."""
        if key not in self._expected:
            # Not part of the sealed dataset (e.g. zarr v2 metadata probes): it did not exist then, so
            # whatever exists now must not leak into reads.
            return None
        # Only ranged reads are followed by more reads of the same file (index, then chunks); whole-file
        # reads are not kept, so the cache never holds more than a few shards being partially read.
        data = await self._verified_bytes(key, prototype, keep=byte_range is not None)
        if byte_range is None:
            view = data
        elif isinstance(byte_range, RangeByteRequest):
            view = data[byte_range.start : byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            view = data[byte_range.offset :]
        elif isinstance(byte_range, SuffixByteRequest):
            view = data[len(data) - byte_range.suffix :]
        else:
            raise ValueError(f"unexpected byte range {byte_range!r}")
        return prototype.buffer.from_bytes(view)

    async def get_partial_values(self, prototype, key_ranges):  # type: ignore[no-untyped-def]
        """Route partial reads through the verified ``get``."""
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def _get_many(self, requests):  # type: ignore[no-untyped-def]
        """Route batched reads through the verified ``get`` (the base wrapper would bypass it)."""
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        """A key exists for readers iff the manifest lists it."""
        return key in self._expected

    async def list(self):  # type: ignore[no-untyped-def]
        """Keys of the sealed dataset (not whatever else is in the directory now)."""
        for key in sorted(self._expected):
            yield key

    async def list_prefix(self, prefix: str):  # type: ignore[no-untyped-def]
        """Sealed keys starting with ``prefix``."""
        for key in sorted(self._expected):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str):  # type: ignore[no-untyped-def]
        """Immediate children of ``prefix`` among the sealed keys."""
        base = prefix.rstrip("/") + "/" if prefix else ""
        seen = set()
        for key in sorted(self._expected):
            if key.startswith(base):
                child = key[len(base) :].split("/", 1)[0]
                if child not in seen:
                    seen.add(child)
                    yield child

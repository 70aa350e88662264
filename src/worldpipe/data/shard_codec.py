"""Fast whole-shard decoding for the one codec chain ``init_store`` writes.

zarr-python decodes every inner chunk through its async codec pipeline (a thread hop per chunk); decoding a
whole shard directly skips those hops (`worldpipe bench loader` measures both). This module handles only
the exact layout below and says so (``ShardFormat.from_array`` returns None otherwise), in which case
callers use zarr. It implements the zarr v3 ``sharding_indexed`` spec for that layout:

- codecs: ``sharding_indexed`` with inner chunks one step along axis 0, inner codecs
  ``bytes`` (little endian) [+ ``zstd``], index codecs ``bytes`` (little endian) + ``crc32c``,
  index at the end;
- a shard file = concatenated inner chunks + index of ``(offset, nbytes)`` uint64 pairs per chunk
  (all-ones = empty chunk) + crc32c of the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import Zstd

_EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
_ZSTD = Zstd()


class ShardFormatError(ValueError):
    """Shard bytes that do not parse (bad index checksum, out-of-range offsets)."""


def _is_little_bytes(codec: dict[str, Any]) -> bool:
    return codec.get("name") == "bytes" and codec.get("configuration", {}).get("endian", "little") == "little"


@dataclass(frozen=True)
class ShardFormat:
    """What is needed to decode one array's shard files without zarr."""

    chunks_per_shard: int
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    compressed: bool
    fill_value: Any

    @classmethod
    def from_array(cls, array: Any) -> ShardFormat | None:
        """The format of a zarr v3 array, or None when its layout is not the one handled here."""
        md = array.metadata.to_dict()
        codecs = md.get("codecs", [])
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return None
        cfg = codecs[0]["configuration"]
        inner = cfg.get("codecs", [])
        index = cfg.get("index_codecs", [])
        if cfg.get("index_location", "end") != "end":
            return None
        if len(index) != 2 or not _is_little_bytes(index[0]) or index[1].get("name") != "crc32c":
            return None
        if not inner or not _is_little_bytes(inner[0]) or len(inner) > 2:
            return None
        compressed = len(inner) == 2
        if compressed and inner[1].get("name") != "zstd":
            return None
        chunk_shape = tuple(cfg["chunk_shape"])
        shard_shape = tuple(md["chunk_grid"]["configuration"]["chunk_shape"])
        if (
            chunk_shape[0] != 1
            or chunk_shape[1:] != shard_shape[1:]
            or tuple(array.shape[1:]) != chunk_shape[1:]
        ):
            return None
        return cls(
            chunks_per_shard=shard_shape[0],
            chunk_shape=chunk_shape[1:],
            dtype=np.dtype(array.dtype).newbyteorder("<"),
            compressed=compressed,
            fill_value=array.fill_value,
        )

    def decode(self, raw: bytes | None, count: int, name: str = "shard") -> np.ndarray:
        """First ``count`` chunks of a shard file as ``[count, *chunk_shape]`` (fill value if ``raw`` is None)."""
        out = np.empty((count, *self.chunk_shape), dtype=self.dtype.newbyteorder("="))
        if raw is None:
            out.fill(self.fill_value)
            return out
        n = self.chunks_per_shard
        index_size = 16 * n + 4
        if len(raw) < index_size:
            raise ShardFormatError(f"{name}: {len(raw)} bytes is shorter than its index")
        index_bytes = raw[-index_size:-4]
        crc = np.frombuffer(raw[-4:], dtype="<u4")[0]
        if np.uint32(google_crc32c.value(index_bytes)) != crc:
            raise ShardFormatError(f"{name}: shard index checksum mismatch")
        index = np.frombuffer(index_bytes, dtype="<u8").reshape(n, 2)
        data_end = len(raw) - index_size
        chunk_elems = int(np.prod(self.chunk_shape))
        for i in range(count):
            offset, nbytes = index[i]
            if offset == _EMPTY and nbytes == _EMPTY:
                out[i].fill(self.fill_value)
                continue
            offset, nbytes = int(offset), int(nbytes)
            if offset + nbytes > data_end:
                raise ShardFormatError(f"{name}: chunk {i} lies outside the shard data")
            payload = raw[offset : offset + nbytes]
            if self.compressed:
                payload = _ZSTD.decode(payload)
            values = np.frombuffer(payload, dtype=self.dtype)
            if values.size != chunk_elems:
                raise ShardFormatError(
                    f"{name}: chunk {i} decodes to {values.size} values, expected {chunk_elems}"
                )
            out[i] = values.reshape(self.chunk_shape)
        return out

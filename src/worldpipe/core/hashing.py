"""Canonical JSON and the hashes taken over it: one encoding for every content hash worldpipe records.

Sorted keys, no whitespace, ASCII only, and no NaN/Infinity (they have no JSON spelling, so two writers could
disagree on them). Values JSON cannot encode (paths, enums) are hashed by their ``str``. Config hashes, run and
dataset directory names, dataset manifests and checkpoint manifests all use this encoding, so a hash computed
in one place can be recomputed in any other.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """The canonical byte form of ``obj`` (sorted keys, compact, ASCII, no NaN; ``str`` for the rest)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False,
                      default=str).encode()


_JSON_SCALARS = (bool, int, float, str, type(None))


def only_json_scalars(items: list | tuple) -> bool:
    """True when ``items`` holds JSON scalars only (exact types; a subclass such as an IntEnum does not count):
    a converter has nothing to do inside it (Python's RNG state is a tuple of 625 ints)."""
    return all(type(v) in _JSON_SCALARS for v in items)


def canonical_hash(obj: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()

"""MANIFEST.json: what a published step contains, and checking a step against it.

The manifest lists every file of the step (relative path, size, sha256), the step, the identity of the run,
which file holds which state key, and ``manifest_sha256``: a SHA-256 over the rest of the manifest in
canonical JSON, so a damaged manifest (e.g. a flipped digit in a size or in the identity) is detected too.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worldpipe.core.hashing import canonical_hash

from . import layout
from .shards import is_shape
from .tensorfile import Segment
from .thread_pool import shared_pool

FORMAT = "worldpipe.checkpoint"
FORMAT_VERSION = 1
_HASH_CHUNK = 64 << 20  # large updates: hashlib releases the GIL while it hashes them


def hash_pool() -> ThreadPoolExecutor:
    """Process-wide threads that SHA-256 file contents concurrently with writing and reading them."""
    return shared_pool("ckpt-sha256", max(2, min(4, os.cpu_count() or 2)))


def sha256_segments(segments: Iterable[Segment]) -> str:
    """SHA-256 of the concatenation of ``segments``."""
    h = hashlib.sha256()
    for seg in segments:
        view = memoryview(seg).cast("B") if not isinstance(seg, bytes) else seg
        for start in range(0, len(view), _HASH_CHUNK):
            h.update(view[start:start + _HASH_CHUNK])
    return h.hexdigest()


@dataclass
class FileRecord:
    """One manifest entry."""

    path: str
    size: int
    sha256: str


def build_manifest(step: int, files: list[FileRecord], contents: Mapping, identity: Mapping,
                   tensors: list[dict] | None = None) -> bytes:
    """Encoded MANIFEST.json for a step whose files are ``files``.

    ``tensors``: the table of every stored tensor's path, shape and dtype (:func:`.loadable.tensor_table`), so
    a reader can tell a step that hashes correctly but would not load.
    """
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "created_unix": time.time(),
        "torch_version": torch.__version__,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.path)],
        "contents": dict(contents),
        "world_size": len(contents.get(layout.RNG) or []),
        "identity": dict(identity or {}),
    }
    if tensors is not None:
        body["tensors"] = list(tensors)
    body["manifest_sha256"] = canonical_hash(body)
    return (json.dumps(body, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def parse_manifest(raw: bytes, step: int) -> tuple[dict | None, list[str]]:
    """Decode and validate a manifest; returns (manifest or None, problems naming MANIFEST.json)."""
    where = f"{layout.step_dir_name(step)}/{layout.MANIFEST_NAME}"
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, [f"{where}: unreadable JSON ({exc})"]
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        return None, [f"{where}: not a {FORMAT} manifest"]
    if body.get("format_version") != FORMAT_VERSION:
        return None, [f"{where}: unsupported format_version {body.get('format_version')!r}"]
    claimed = body.pop("manifest_sha256", None)
    try:
        actual = canonical_hash(body)
    except (TypeError, ValueError) as exc:
        return None, [f"{where}: cannot canonicalize ({exc})"]
    if claimed != actual:
        return None, [f"{where}: manifest checksum mismatch (damaged manifest)"]
    if body.get("step") != step:
        return None, [f"{where}: records step {body.get('step')!r}, directory says {step}"]
    problems = _file_problems(body.get("files"), where)
    if not problems:
        problems = _contents_problems(body.get("contents"), {e["path"] for e in body["files"]}, where)
    if not problems and "tensors" in body:  # absent in manifests written before the table existed
        problems = [f"{where}: {p}" for p in table_problems(body["tensors"])]
    body["manifest_sha256"] = claimed
    return (None if problems else body), problems


def table_problems(table: object) -> list[str]:
    """What is malformed in a recorded ``tensors`` table (checked when the manifest is parsed)."""
    if not isinstance(table, list):
        return ["'tensors' is not a list"]
    for entry in table:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), list) and entry["path"]
                and isinstance(entry.get("dtype"), str) and is_shape(entry.get("shape"))):
            return [f"malformed 'tensors' entry {entry!r}"[:200]]
    return []


def illegal_path(path: object) -> bool:
    """True unless ``path`` is a normalized relative path that stays inside the directory it is relative to.

    A manifest (or a shard index) must never make a reader touch files outside its step directory.
    """
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        return True
    return posixpath.normpath(path) != path or path.startswith(("/", "../")) or path in (".", "..") or "/../" in path


def _file_problems(files: object, where: str) -> list[str]:
    """Every ``files`` entry: a confined relative path, an integer size and a SHA-256."""
    if not isinstance(files, list):
        return [f"{where}: 'files' is not a list"]
    problems = []
    for entry in files:
        path = entry.get("path") if isinstance(entry, dict) else None
        if illegal_path(path):
            problems.append(f"{where}: illegal file path {path!r}")
        elif (isinstance(entry.get("size"), bool) or not isinstance(entry.get("size"), int) or entry["size"] < 0
              or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64):
            problems.append(f"{where}: file {path!r} lacks a valid size and sha256")
    return problems


def _contents_problems(contents: object, listed: set[str], where: str) -> list[str]:
    """Every path the ``contents`` table names is confined and listed in ``files`` (so size- and hash-checked)."""
    if not isinstance(contents, dict):
        return [f"{where}: 'contents' is not a table"]
    problems = []
    for key, value in contents.items():
        for path in _named_paths(value):
            if path is None and not isinstance(value, list):
                continue
            if illegal_path(path):
                problems.append(f"{where}: contents.{key} names an illegal path {path!r}")
            elif path not in listed:
                problems.append(f"{where}: contents.{key} names {path!r}, which is not listed in files")
    return problems


def _named_paths(value: object) -> list:
    # A table (sharded checkpoints: {"index": path, "files": [paths], "world_size": n}) names its string leaves.
    if isinstance(value, dict):
        return [p for v in value.values() if not isinstance(v, int) for p in _named_paths(v)]
    return value if isinstance(value, list) else [value]


def check_sizes(manifest: Mapping, step: int, size_of, only: set[str] | None = None) -> list[str]:
    """Problems of presence and size of the step's files (``size_of(relpath)``: size or None when missing)."""
    return _mismatches(step, [(e, e["path"]) for e in _selected(manifest, only)], size_of,
                       lambda size, e: "missing" if size is None else
                       f"size {size} != {e['size']} in manifest" if size != e["size"] else None)


def start_hashes(manifest: Mapping, sha256_of, only: set[str] | None = None) -> list[tuple[dict, Future]]:
    """Start hashing the step's files on the hash threads (``sha256_of(relpath)``); see :func:`collect_hashes`."""
    return [(entry, hash_pool().submit(sha256_of, entry["path"])) for entry in _selected(manifest, only)]


def collect_hashes(step: int, pending: list[tuple[dict, Future]]) -> list[str]:
    """Wait for :func:`start_hashes` and return the mismatches, naming each file."""
    return _mismatches(step, pending, Future.result, lambda digest, e: (
        f"sha256 {digest[:16]}... != {e['sha256'][:16]}... in manifest" if digest != e["sha256"] else None))


def _selected(manifest: Mapping, only: set[str] | None) -> list[dict]:
    return [entry for entry in manifest["files"] if only is None or entry["path"] in only]


def _mismatches(step: int, pending: list[tuple[dict, object]], get, problem) -> list[str]:
    """Each file's ``problem(get(item), entry)``, named; an OSError of ``get`` makes it unreadable."""
    problems = []
    for entry, item in pending:
        try:
            found = problem(get(item), entry)
        except OSError as exc:
            found = f"unreadable ({exc})"
        if found:
            problems.append(f"{layout.step_dir_name(step)}/{entry['path']}: {found}")
    return problems

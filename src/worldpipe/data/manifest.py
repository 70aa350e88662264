"""Dataset manifest: every store file with size and sha256, array shapes, spec, and one dataset hash."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import fsspec

from worldpipe.config.paths import STORE_NAME, dataset_dir
from worldpipe.core.atomic import fsync_ancestors, fsync_tree, write_atomic
from worldpipe.core.errors import UserError
from worldpipe.core.hashing import canonical_hash
from worldpipe.core.locations import list_files, local_path, open_filesystem
from worldpipe.data.store import TrajectoryStore, array_layout

MANIFEST_FORMAT = "worldpipe.data.manifest/1"
_HASH_BLOCK = 1 << 20
# Files a workflow engine leaves in a store directory that are not data: Snakemake touches this marker in every
# directory() output (init_store's store). Hashing it made a pipeline-built dataset differ from the same data
# built by `worldpipe rerun` (in-process, no marker), so reruns of pipeline runs could never regenerate it.
WORKFLOW_MARKERS = frozenset({".snakemake_timestamp"})


class ManifestError(UserError, ValueError):
    """A dataset manifest that is malformed or was modified after sealing; the message names the file."""


def dataset_hash(manifest: dict) -> str:
    """sha256 of the canonical JSON of the manifest without its ``dataset_hash`` field."""
    body = {k: v for k, v in manifest.items() if k != "dataset_hash"}
    return canonical_hash(body)


def _file_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _check_complete(store: TrajectoryStore, files: dict[str, int]) -> None:
    # Sealing an unfinished dataset would bless missing shards (read back as zeros) as the truth.
    partial = [p for p in files if p.endswith(".partial")]
    if partial:
        raise ValueError(f"store has in-flight or abandoned temp files, refusing to seal: {partial[:5]}")
    missing = [
        a.shard_key(s)
        for a in array_layout(store.spec)
        for s in range(store.spec.num_shards)
        if a.shard_key(s) not in files
    ]
    if missing:
        raise ValueError(f"store is incomplete, {len(missing)} shard file(s) missing, e.g. {missing[:5]}")
    unwritten = (store.lengths <= 0).nonzero()[0]
    if unwritten.size:
        raise ValueError(f"store has {unwritten.size} unwritten episode(s), e.g. {unwritten[:5].tolist()}")


def build_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict:
    """Compute the manifest of the store at ``url`` (no I/O besides reading the store)."""
    store = TrajectoryStore.open(url, storage_options=storage_options)
    fs, root = open_filesystem(url, storage_options)
    files = {rel: size for rel, size in list_files(fs, root).items() if rel not in WORKFLOW_MARKERS}
    _check_complete(store, files)
    arrays = store.array_info()
    for a in array_layout(store.spec):
        arrays[a.name].update(chunks=list(a.chunks), shards=list(a.shards(store.spec.episodes_per_shard)))
    manifest = {
        "format": MANIFEST_FORMAT,
        "spec": store.spec.to_dict(),
        "episodes": store.num_episodes,
        "steps": int(store.lengths.sum()),
        "arrays": arrays,
        "files": [
            {"path": rel, "size": size, "sha256": _file_sha256(fs, f"{root}/{rel}")}
            for rel, size in files.items()
        ],
    }
    if store.lineage is not None:
        manifest["lineage"] = store.lineage  # covered by the dataset hash like the files
    manifest["dataset_hash"] = dataset_hash(manifest)
    return manifest


def _write_manifest(manifest_path: str, data: bytes, storage_options: dict[str, Any] | None) -> None:
    path = local_path(manifest_path)
    if path is not None:
        write_atomic(path, data)
    else:
        # Object stores publish a single PUT atomically; there is no rename to do.
        fs, target = fsspec.core.url_to_fs(manifest_path, **dict(storage_options or {}))
        fs.pipe_file(target, data)


def seal_dataset(url: str, manifest_path: str, storage_options: dict[str, Any] | None = None) -> dict:
    """Hash every file of the store at ``url`` and publish the manifest atomically at ``manifest_path``.

    Contains no timestamps or locations, so resealing identical data yields a byte-identical manifest.
    For local stores every file and directory is fsynced first, so a durable manifest implies durable data.
    """
    store_root = local_path(url)
    if store_root is not None:
        # zarr's LocalStore renames files into place but never fsyncs: make the data durable before the
        # manifest that vouches for it is.
        fsync_tree(store_root)
        # ... and the names leading to it: zarr and the workflow make the dataset's directories without fsyncing
        # their parents, so a power cut could lose a sealed dataset whole.
        fsync_ancestors(store_root)
    manifest = build_manifest(url, storage_options)
    text = json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True) + "\n"
    _write_manifest(manifest_path, text.encode(), storage_options)
    manifest_dir = local_path(os.path.dirname(manifest_path))
    if manifest_dir is not None and os.path.abspath(manifest_dir) != os.path.dirname(os.path.abspath(store_root or "")):
        fsync_ancestors(manifest_dir)  # a manifest kept apart from its store: its own names too
    return manifest


def load_manifest(path: str, storage_options: dict[str, Any] | None = None) -> dict:
    """Read a manifest; ValueError if it is malformed or its dataset_hash does not match its content."""
    local = local_path(path)
    if local is not None:
        with open(local, "rb") as f:
            raw = f.read()
    else:
        fs, target = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
        raw = fs.cat_file(target)
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path!r} is not a {MANIFEST_FORMAT} manifest")
    if manifest.get("dataset_hash") != dataset_hash(manifest):
        raise ManifestError(f"manifest {path!r} was modified: dataset_hash does not match its content")
    return manifest


def verify_dataset(url: str, manifest_path: str, storage_options: dict[str, Any] | None = None) -> list[dict]:
    """Compare the store with its manifest, one record per file, sorted by path.

    status: "ok", "mismatch" (sha256 differs), "size" (size differs), "missing", or "extra" (not in
    the manifest).
    """
    manifest = load_manifest(manifest_path, storage_options)
    fs, root = open_filesystem(url, storage_options)
    actual = list_files(fs, root)
    results = []
    for entry in manifest["files"]:
        rel = entry["path"]
        record = {"path": rel, "expected_size": entry["size"], "expected_sha256": entry["sha256"]}
        if rel not in actual:
            record["status"] = "missing"
        elif actual[rel] != entry["size"]:
            record.update(status="size", size=actual[rel])
        else:
            digest = _file_sha256(fs, f"{root}/{rel}")
            record.update(
                status="ok" if digest == entry["sha256"] else "mismatch", size=actual[rel], sha256=digest
            )
        results.append(record)
    listed = {e["path"] for e in manifest["files"]}
    results.extend(
        {"path": rel, "status": "extra", "size": size} for rel, size in actual.items()
        if rel not in listed and rel not in WORKFLOW_MARKERS  # a manifest sealed before they were left out lists them
    )
    return sorted(results, key=lambda r: r["path"])


def describe_dataset(
    url: str, manifest_path: str | None = None, storage_options: dict[str, Any] | None = None
) -> dict:
    """Summary for ``worldpipe data info``: episodes, steps, shapes, bytes on disk, dataset hash."""
    store = TrajectoryStore.open(url, storage_options=storage_options)
    fs, root = open_filesystem(url, storage_options)
    files = list_files(fs, root)
    lengths = store.lengths
    info = {
        "url": url,
        "name": store.spec.name,
        "spec": store.spec.to_dict(),
        "episodes": store.num_episodes,
        "steps": int(lengths.sum()),
        "episode_length": {
            "min": int(lengths.min()),
            "mean": float(lengths.mean()),
            "max": int(lengths.max()),
        },
        "obs_dim": store.obs_dim,
        "act_dim": store.act_dim,
        "arrays": store.array_info(),
        "num_shards": store.num_shards,
        "files": len(files),
        "bytes_on_disk": int(sum(files.values())),
        "dataset_hash": None,
    }
    if manifest_path is not None:
        info["dataset_hash"] = load_manifest(manifest_path, storage_options)["dataset_hash"]
    info["lineage"] = lineage_chain(store)
    return info


def lineage_chain(store: TrajectoryStore) -> list[str]:
    """Where a dataset's episodes come from, one line per round back to round 0 (the scripted policy's data).

    Each collected round names the run whose model collected it (its checkpoint step and digest, its MLflow run)
    and the dataset that run trained on, which is followed in turn while it is on disk.
    """
    lines, seen = [], store
    while seen is not None and seen.lineage is not None:
        record, parent = seen.lineage, seen.lineage["parent"]
        collector, episodes = record["collector"], record["episodes"]
        lines.append(f"round {record['round']} ({seen.spec.name}): {episodes['collected']} episodes collected by the "
                     f"model of {collector['run_dir']} (step {collector['checkpoint_step']}, digest "
                     f"{collector['checkpoint_digest'][:16]}…, MLflow run {collector['mlflow_run_id']}), "
                     f"{episodes['copied']} copied; trained on {parent['name']} (dataset {parent['dataset_hash'][:16]}…)")
        where = f"{dataset_dir(parent['name'], parent['spec_hash'])}/{STORE_NAME}"
        try:
            seen = TrajectoryStore.open(where)
        except (OSError, ValueError):
            lines.append(f"round {record['round'] - 1} ({parent['name']}): not on disk at {where}")
            return lines
    origin = f"{seen.num_episodes} episodes of the scripted policy {seen.spec.policy!r} (seed {seen.spec.seed})"
    lines.append(f"round 0 ({seen.spec.name}): {origin}" if lines else origin)
    return lines

"""One-call dataset build: init, simulate every shard (optionally in parallel processes), seal."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from worldpipe.data.manifest import seal_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import init_store, write_shards


def partition_shards(num_shards: int, jobs: int) -> list[list[int]]:
    """Split shard indices into ``jobs`` interleaved groups (balances uneven shard costs)."""
    jobs = max(1, min(jobs, num_shards))
    return [list(range(j, num_shards, jobs)) for j in range(jobs)]


def build_dataset(
    url: str,
    spec: DatasetSpec,
    manifest_path: str | None = None,
    jobs: int = 1,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict:
    """Create the complete store for ``spec`` at ``url``; seal it when ``manifest_path`` is given.

    Returns ``{"shards": [per-shard records], "manifest": manifest or None}``. The bytes written do not
    depend on ``jobs``.
    """
    groups = partition_shards(spec.num_shards, jobs)
    if len(groups) > 1 and url.startswith("memory://"):
        raise ValueError("memory:// stores live in one process; use jobs=1")
    init_store(url, spec, storage_options=storage_options)
    if len(groups) == 1:
        records = write_shards(url, spec, groups[0], progress=progress, storage_options=storage_options)
    else:
        # spawn, not fork: the parent may hold event-loop / OpenMP threads that a forked child inherits
        # in a broken state.
        with ProcessPoolExecutor(
            max_workers=len(groups), mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            futures = [
                pool.submit(write_shards, url, spec, g, progress=False, storage_options=storage_options)
                for g in groups
            ]
            records = [r for f in futures for r in f.result()]
    records.sort(key=lambda r: r["index"])
    manifest = None
    if manifest_path is not None:

        manifest = seal_dataset(url, manifest_path, storage_options=storage_options)
    return {"shards": records, "manifest": manifest}

"""Small real datasets: simulated Pendulum episodes in a real zarr store, sealed with a manifest.

Built in the test process with the library call the data rules' commands make (`worldpipe data init`, `write`,
`seal` are :func:`worldpipe.data.build.build_dataset` in three steps): the same bytes and dataset hash
(`tests/data/test_data_pipeline.py` checks it against the commands), without three fresh interpreters.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SMOKE_SPEC = {
    "name": "smoke", "env_id": "Pendulum-v1", "policy": "noisy_controller", "episodes": 24, "max_steps": 64,
    "episodes_per_shard": 4, "seed": 0, "pixels": False, "pixel_size": 32, "compressor": "zstd",
}


def build_dataset(root: Path, env: dict | None = None, spec: dict | None = None) -> tuple[Path, Path]:
    """Store and manifest of ``spec`` (default: the smoke spec) under ``root``; returns (store, manifest).

    ``env`` is unused (kept for the callers that pass the test environment)."""
    from worldpipe.data.build import build_dataset as build
    from worldpipe.data.spec import DatasetSpec

    store, manifest = root / "store.zarr", root / "manifest.json"
    build(str(store), DatasetSpec.from_dict(dict(spec or SMOKE_SPEC)), manifest_path=str(manifest))
    return store, manifest


def build_dataset_with_the_cli(root: Path, env: dict, spec: dict | None = None) -> tuple[Path, Path]:
    """The same through `worldpipe data init`, `write` and `seal`, as the Snakemake rules run them."""
    spec = dict(spec or SMOKE_SPEC)
    store, manifest = root / "store.zarr", root / "manifest.json"
    text = json.dumps(spec)
    shards = -(-spec["episodes"] // spec["episodes_per_shard"])
    for args in (
        ["data", "init", "--spec", text, "--store", str(store)],
        ["data", "write", "--spec", text, "--store", str(store), "--shards", f"0:{shards}", "--no-progress"],
        ["data", "seal", "--store", str(store), "--manifest", str(manifest)],
    ):
        subprocess.run(["worldpipe", *args], check=True, env=env, capture_output=True, timeout=300)
    return store, manifest

"""Build small real datasets through the CLI, exactly as the Snakemake rules do."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SMOKE_SPEC = {
    "name": "smoke", "env_id": "Pendulum-v1", "policy": "noisy_controller", "episodes": 24, "max_steps": 64,
    "episodes_per_shard": 4, "seed": 0, "pixels": False, "pixel_size": 32, "compressor": "zstd",
}


def build_dataset(root: Path, env: dict, spec: dict | None = None) -> tuple[Path, Path]:
    """init + write all shards + seal; returns (store path, manifest path)."""
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

"""`worldpipe data ...`: generate, seal, verify and describe trajectory stores."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    data = sub.add_parser("data", help="trajectory datasets").add_subparsers(dest="data_command", required=True)

    init = data.add_parser("init", help="create the zarr store's arrays (metadata only)")
    init.add_argument("--spec", required=True, help="dataset spec as JSON (see conf/pipeline/default.yaml)")
    init.add_argument("--store", required=True)
    init.set_defaults(handler=_init)

    write = data.add_parser("write", help="simulate and write a range of shards")
    write.add_argument("--spec", required=True)
    write.add_argument("--store", required=True)
    write.add_argument("--shards", required=True, help="START:STOP shard range")
    write.add_argument("--no-progress", action="store_true")
    write.set_defaults(handler=_write)

    seal = data.add_parser("seal", help="hash every store file into manifest.json (written last, atomically)")
    seal.add_argument("--store", required=True)
    seal.add_argument("--manifest", required=True)
    seal.set_defaults(handler=_seal)

    verify = data.add_parser("verify", help="check every file against the manifest")
    verify.add_argument("path", help="dataset directory (holding store.zarr and manifest.json) or store URL")
    verify.add_argument("--manifest")
    verify.set_defaults(handler=_verify)

    info = data.add_parser("info", help="episodes, steps, shapes, size, dataset hash")
    info.add_argument("path")
    info.add_argument("--manifest")
    info.set_defaults(handler=_info)


def _spec(text: str):
    from worldpipe.data.spec import DatasetSpec

    return DatasetSpec.from_dict(json.loads(text))


def _locate(path: str, manifest: str | None) -> tuple[str, str | None]:
    """Accept a dataset directory (store.zarr + manifest.json inside) or an explicit store URL."""
    from pathlib import Path

    from worldpipe.config.paths import MANIFEST_NAME, STORE_NAME

    base = Path(path)
    if (base / STORE_NAME).exists():
        return str(base / STORE_NAME), manifest or str(base / MANIFEST_NAME)
    return path, manifest


def _init(args) -> int:
    from worldpipe.data.store import init_store

    init_store(args.store, _spec(args.spec))
    return 0


def _write(args) -> int:
    from worldpipe.data.store import write_shards

    start, stop = (int(x) for x in args.shards.split(":"))
    records = write_shards(args.store, _spec(args.spec), range(start, stop), progress=not args.no_progress)
    print(json.dumps(records))
    return 0


def _seal(args) -> int:
    from worldpipe.data.manifest import seal_dataset

    manifest = seal_dataset(args.store, args.manifest)
    print(f"dataset_hash {manifest['dataset_hash']}")
    return 0


def _verify(args) -> int:
    from worldpipe.data.manifest import verify_dataset

    store, manifest = _locate(args.path, args.manifest)
    if manifest is None:
        print("error: --manifest is required for a store URL", file=sys.stderr)
        return 2
    statuses = verify_dataset(store, manifest)
    bad = [s for s in statuses if s["status"] != "ok"]
    for status in statuses:
        print(f"{status['status']:>8}  {status['path']}")
    print(f"{len(statuses) - len(bad)} ok, {len(bad)} problem(s)")
    return 1 if bad else 0


def _info(args) -> int:
    from worldpipe.data.manifest import describe_dataset

    store, manifest = _locate(args.path, args.manifest)
    for key, value in describe_dataset(store, manifest).items():
        print(f"{key}: {value}")
    return 0

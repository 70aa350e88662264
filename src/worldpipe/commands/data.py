"""`worldpipe data ...`: generate, seal, verify and describe trajectory stores."""

from __future__ import annotations

import json
import sys

import click

from worldpipe.commands import command, group


def register(cli: click.Group) -> None:
    data = group("data", "trajectory datasets")
    spec = click.Option(["--spec"], required=True, help="dataset spec as JSON (see conf/pipeline/default.yaml)")
    store = click.Option(["--store"], required=True, help="the zarr store (path or URL)")
    path = "PATH: dataset directory (holding store.zarr and manifest.json) or store URL."
    manifest = click.Option(["--manifest"], help="manifest.json (default: PATH/manifest.json; required for a URL)")
    for cmd in (
        command("init", _init, "Create the zarr store's arrays (metadata only).", [spec, store]),
        command("write", _write, "Simulate and write a range of shards.", [
            spec, store, click.Option(["--shards"], required=True, help="START:STOP[:STEP] shard range"),
            click.Option(["--no-progress"], is_flag=True, help="no progress bar")]),
        command("seal", _seal, "Hash every store file into manifest.json (written last, atomically).", [
            store, click.Option(["--manifest"], required=True, help="manifest.json to write")]),
        command("verify", _verify, f"Check every file against the manifest.\n\n{path}",
                [click.Argument(["path"]), manifest]),
        command("info", _info, f"Episodes, steps, shapes, size, dataset hash.\n\n{path}",
                [click.Argument(["path"]), manifest]),
    ):
        data.add_command(cmd)
    cli.add_command(data)


def _spec(text: str):
    from worldpipe.core.errors import UsageError
    from worldpipe.data.spec import DatasetSpec

    try:
        return DatasetSpec.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as err:
        raise UsageError(f"--spec: not a dataset spec ({err}); see `datasets:` in conf/pipeline/default.yaml") from None


def _locate(path: str, manifest: str | None) -> tuple[str, str | None]:
    """Accept a dataset directory (store.zarr + manifest.json inside) or an explicit store URL."""
    from pathlib import Path

    from worldpipe.config.paths import MANIFEST_NAME, STORE_NAME

    base = Path(path)
    if (base / STORE_NAME).exists():
        return str(base / STORE_NAME), manifest or str(base / MANIFEST_NAME)
    return path, manifest


def _init(args) -> int:
    spec = _spec(args.spec)
    if spec.collector is not None:  # a collection round: its lineage is fixed now, from the collecting run
        from worldpipe.control.collection import init_collected_store

        init_collected_store(args.store, spec)
        return 0
    from worldpipe.data.store import init_store

    init_store(args.store, spec)
    return 0


def _shard_indices(text: str) -> range:
    """START:STOP or START:STOP:STEP (a collection round's parts take every STEP-th shard: balanced work)."""
    try:
        return range(*(int(x) for x in text.split(":")))
    except (TypeError, ValueError):
        raise click.BadParameter(f"--shards {text!r}: expected START:STOP or START:STOP:STEP") from None


def _write(args) -> int:
    spec, shards = _spec(args.spec), _shard_indices(args.shards)
    if spec.collector is not None:
        from worldpipe.control.collection import write_collected_shards

        records = write_collected_shards(args.store, spec, shards, log=lambda line: print(line, file=sys.stderr))
    else:
        from worldpipe.data.store import write_shards

        records = write_shards(args.store, spec, shards, progress=not args.no_progress)
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
        from worldpipe.core.errors import UsageError

        raise UsageError(f"{args.path}: --manifest is required for a store URL")
    statuses = verify_dataset(store, manifest)
    bad = [s for s in statuses if s["status"] != "ok"]
    for status in statuses:
        print(f"{status['status']:>8}  {status['path']}")
    print(f"{len(statuses) - len(bad)} ok, {len(bad)} problem(s)")
    return 1 if bad else 0


def _info(args) -> int:
    from worldpipe.data.manifest import describe_dataset

    store, manifest = _locate(args.path, args.manifest)
    info = describe_dataset(store, manifest)
    chain = info.pop("lineage")
    for key, value in info.items():
        print(f"{key}: {value}")
    print("lineage:")  # newest round first, back to the scripted policy's data
    for line in chain:
        print(f"  {line}")
    return 0

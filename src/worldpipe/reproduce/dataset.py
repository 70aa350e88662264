"""The dataset of a recorded run: found where it was, found where it was regenerated, or regenerated in-process."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from worldpipe.config import paths
from worldpipe.core.locations import resolve_against
from worldpipe.data.build import build_dataset
from worldpipe.data.manifest import load_manifest, verify_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.reproduce.drift import RerunError
from worldpipe.tracking.history import RecordedRun

log = logging.getLogger("worldpipe.rerun")


def resolve_recorded_path(path: str, cwd: str | None) -> str:
    """A recorded relative path, resolved against the directory the run was started from."""
    return resolve_against(path, cwd)


def _dataset_ok(store: str, manifest_path: str, expected: str) -> bool:

    try:
        if load_manifest(manifest_path)["dataset_hash"] != expected:
            return False
        return all(status["status"] == "ok" for status in verify_dataset(store, manifest_path))
    except Exception as err:  # noqa: BLE001 - missing or unreadable: not this dataset
        log.info("dataset at %s not usable: %s", store, err)
        return False


def regenerate_dataset(spec: dict, target: Path, lineage: dict | None = None,
                       ancestors: Callable[[DatasetSpec, dict], None] | None = None) -> tuple[str, str]:
    """Build and seal the dataset of a recorded generation spec in this process (the same code the rules run).

    ``lineage``: the recorded origin of a collection round's data (its collecting run, checkpoint digest and parent
    dataset), reproduced as recorded. ``ancestors``: called first with (spec, lineage) to put the collecting run and
    the parent dataset back where the round expects them; without it, a missing one is named in one line.
    """
    store, manifest = target / paths.STORE_NAME, target / paths.MANIFEST_NAME
    if store.exists():
        shutil.rmtree(store)
    manifest.unlink(missing_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    # start-up: the collecting model (torch) loads only where a collection round's data is regenerated
    from worldpipe.control.collection import CollectionError, build_collected_dataset

    try:
        parsed = DatasetSpec.from_dict(spec)
        if parsed.collector is not None:  # a collection round: played again by its recorded collecting model
            if ancestors is not None and lineage is not None:
                ancestors(parsed, lineage)
            build_collected_dataset(str(store), parsed, str(manifest), lineage)
        else:
            build_dataset(str(store), parsed, manifest_path=str(manifest))
    except CollectionError as err:
        origin = (lineage or {}).get("collector", {}).get("mlflow_run_id")
        hint = f"; rebuild that run first (worldpipe rerun {origin}), or pass --chain" if origin else ""
        raise RerunError(f"cannot regenerate round {parsed.collector['round']}'s data: {err}{hint}") from None
    except (ValueError, OSError) as err:
        raise RerunError(f"cannot regenerate the dataset into {target}: {err}") from err
    return str(store), str(manifest)


def locate_dataset(recorded: RecordedRun, data_dir: str | None = None, regenerate: bool = False,
                   ancestors: Callable[[DatasetSpec, dict], None] | None = None) -> tuple[str, str, str]:
    """(store, manifest, how): the recorded location if it still holds the recorded hash, else a regeneration.

    ``regenerate``: build the data again from the recorded spec even where it is on disk (a collection round's
    data played again by its collecting model), and require the recorded hash.
    """
    expected = recorded.identity.get("dataset_hash") or recorded.tags.get("worldpipe.dataset_hash")
    cwd = recorded.tags.get("worldpipe.cwd")
    data = recorded.config.get("data", {})
    store, manifest = resolve_recorded_path(str(data.get("store")), cwd), resolve_recorded_path(str(data.get("manifest")), cwd)
    if not regenerate and _dataset_ok(store, manifest, expected):
        return store, manifest, "recorded location"
    target = Path(data_dir) if data_dir else Path(paths.layout()["data"]) / f"rerun-{expected[:16]}"
    again = str(target / paths.STORE_NAME), str(target / paths.MANIFEST_NAME)
    if not regenerate and _dataset_ok(*again, expected):
        return *again, "earlier regeneration"
    spec = (recorded.manifest or {}).get("spec")
    if not spec:
        raise RerunError(f"dataset {expected[:16]}… is not at {store} and the run's dataset/manifest.json artifact "
                         "holds no generation spec; pass --data-dir with the original dataset")
    log.info("regenerating dataset %s… from its recorded spec into %s", expected[:16], target)
    store, manifest = regenerate_dataset(spec, target, (recorded.manifest or {}).get("lineage"), ancestors)

    got = load_manifest(manifest)["dataset_hash"]
    if got != expected:
        raise RerunError(f"the regenerated dataset has hash {got[:16]}…, the run was trained on {expected[:16]}…: "
                         "data generation is not reproducible here (code or package drift?)")
    return store, manifest, "regenerated"

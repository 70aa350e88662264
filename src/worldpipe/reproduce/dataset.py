"""The dataset of a recorded run: found where it was, found where it was regenerated, or regenerated in-process."""

from __future__ import annotations

import logging
import shutil
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


def regenerate_dataset(spec: dict, target: Path) -> tuple[str, str]:
    """Build and seal the dataset of a recorded generation spec in this process (the same code the rules run)."""
    store, manifest = target / paths.STORE_NAME, target / paths.MANIFEST_NAME
    if store.exists():
        shutil.rmtree(store)
    manifest.unlink(missing_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    try:
        build_dataset(str(store), DatasetSpec.from_dict(spec), manifest_path=str(manifest))
    except (ValueError, OSError) as err:
        raise RerunError(f"cannot regenerate the dataset into {target}: {err}") from err
    return str(store), str(manifest)


def locate_dataset(recorded: RecordedRun, data_dir: str | None = None) -> tuple[str, str, str]:
    """(store, manifest, how): the recorded location if it still holds the recorded hash, else a regeneration."""
    expected = recorded.identity.get("dataset_hash") or recorded.tags.get("worldpipe.dataset_hash")
    cwd = recorded.tags.get("worldpipe.cwd")
    data = recorded.config.get("data", {})
    store, manifest = resolve_recorded_path(str(data.get("store")), cwd), resolve_recorded_path(str(data.get("manifest")), cwd)
    if _dataset_ok(store, manifest, expected):
        return store, manifest, "recorded location"
    target = Path(data_dir) if data_dir else Path(paths.layout()["data"]) / f"rerun-{expected[:16]}"
    again = str(target / paths.STORE_NAME), str(target / paths.MANIFEST_NAME)
    if _dataset_ok(*again, expected):
        return *again, "earlier regeneration"
    spec = (recorded.manifest or {}).get("spec")
    if not spec:
        raise RerunError(f"dataset {expected[:16]}… is not at {store} and the run's dataset/manifest.json artifact "
                         "holds no generation spec; pass --data-dir with the original dataset")
    log.info("regenerating dataset %s… from its recorded spec into %s", expected[:16], target)
    store, manifest = regenerate_dataset(spec, target)

    got = load_manifest(manifest)["dataset_hash"]
    if got != expected:
        raise RerunError(f"the regenerated dataset has hash {got[:16]}…, the run was trained on {expected[:16]}…: "
                         "data generation is not reproducible here (code or package drift?)")
    return store, manifest, "regenerated"

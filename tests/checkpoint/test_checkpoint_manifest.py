"""Cases 3 and 4 of issue 9: a manifest's `contents` confined to its step and to `files`; selection means
loadable. Real checkpoints on a real filesystem; the damage is done the way an attacker (or a bug) would."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointCorruptError, CheckpointManager

pytestmark = pytest.mark.adversarial


def _save(root: Path, steps) -> CheckpointManager:
    manager = CheckpointManager(root, keep_last=5)
    for step in steps:
        manager.save(step, example_state(seed=step))
    return manager


def _rewrite_manifest(step_dir: Path, edit) -> None:
    """Apply ``edit`` to MANIFEST.json and recompute its own checksum, as a forger would."""
    path = step_dir / "MANIFEST.json"
    body = json.loads(path.read_text())
    body.pop("manifest_sha256")
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(body, sort_keys=True, indent=2))


def _relist(body: dict, step_dir: Path, relpath: str) -> None:
    """Make the `files` entry of ``relpath`` match the file's current bytes."""
    data = (step_dir / relpath).read_bytes()
    for entry in body["files"]:
        if entry["path"] == relpath:
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_contents_pointing_outside_the_step_is_corrupt(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    manager = _save(root, [10, 20])
    step_dir = root / "step-000020"
    outside = tmp_path / "outside_model.pt"
    torch.save({k: torch.zeros_like(v) for k, v in example_state()["model"].items()}, outside)
    rel = "../../../outside_model.pt"
    assert (step_dir / rel).resolve() == outside.resolve()

    _rewrite_manifest(step_dir, lambda body: body["contents"].update(model=rel))

    problems = manager.verify(20)
    assert problems and "contents.model" in problems[0] and "step-000020" in problems[0]
    assert manager.latest_intact() == 10
    assert manager.latest_loadable() == 10
    with pytest.raises(CheckpointCorruptError, match="contents.model"):
        manager.load(20)
    assert torch.equal(manager.load()["model"]["0.weight"], example_state(seed=10)["model"]["0.weight"])


def test_contents_naming_an_unlisted_file_is_corrupt(tmp_path):
    root = tmp_path / "checkpoints"
    manager = _save(root, [10, 20])
    step_dir = root / "step-000020"
    # A file inside the step directory, but not in `files`: its size and hash would never be checked.
    (step_dir / "model_unlisted.pt").write_bytes((step_dir / "model.pt").read_bytes())
    _rewrite_manifest(step_dir, lambda body: body["contents"].update(model="model_unlisted.pt"))

    problems = manager.verify(20)
    assert problems and "not listed in files" in problems[0]
    assert manager.latest_loadable() == 10


@pytest.mark.parametrize("path", ["/etc/passwd", "a/../../x.pt", "..", "./model.pt", "model.pt/"])
def test_illegal_contents_paths_are_refused(tmp_path, path):
    root = tmp_path / "checkpoints"
    manager = _save(root, [10])
    _rewrite_manifest(root / "step-000010", lambda body: body["contents"].update(model=path))
    problems = manager.verify(10)
    assert problems and "contents.model" in problems[0], problems


def test_rng_list_entries_are_confined_too(tmp_path):
    root = tmp_path / "checkpoints"
    manager = _save(root, [10])
    _rewrite_manifest(root / "step-000010", lambda body: body["contents"].update(rng=["../../rng.pt"]))
    assert "contents.rng" in manager.verify(10)[0]


class Payload:
    """A pickled object of a class that `torch.load(weights_only=True)` rightly refuses to build."""


def test_hash_valid_but_unloadable_step_is_skipped_by_name(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    manager = _save(root, [10, 20])
    step_dir = root / "step-000020"
    torch.save({"weights": Payload()}, step_dir / "model.pt")
    _rewrite_manifest(step_dir, lambda body: _relist(body, step_dir, "model.pt"))
    assert manager.verify(20) == []  # every hash matches: only loading can tell

    with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
        chosen = manager.latest_loadable()
    assert chosen == 10
    assert any("step-000020" in r.getMessage() and "model.pt" in r.getMessage() for r in caplog.records)
    state = manager.load(chosen)  # handed over from the selection, not read twice
    assert torch.equal(state["model"]["0.weight"], example_state(seed=10)["model"]["0.weight"])
    assert manager.load(10)["progress"] == example_state(seed=10)["progress"]


def test_nothing_loadable_means_none(tmp_path):
    root = tmp_path / "checkpoints"
    manager = _save(root, [10])
    torch.save({"weights": Payload()}, root / "step-000010" / "model.pt")
    _rewrite_manifest(root / "step-000010", lambda body: _relist(body, root / "step-000010", "model.pt"))
    assert manager.latest_loadable() is None

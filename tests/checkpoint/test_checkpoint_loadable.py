"""Issue 19, cases 1-4: a checkpoint that verifies is a checkpoint that loads, and every reader agrees on which.

Real checkpoints on a real filesystem, damaged the way a forger (or a bug) would: files re-saved and the manifest
re-hashed so that every checksum matches. `ckpt verify` must fail the step naming the damage; the newest
loadable step (chosen once, in worldpipe.checkpoint.loadable) is the one training resumes from and the one `ckpt
digest` digests, and each step skipped is reported on one line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from checkpoint_states import rehash_step, slice_model_file
from worldpipe.checkpoint import CheckpointCorruptError, CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.checkpointer import Checkpointer, Progress, TrainingComponents
from worldpipe.cli import main as cli
from worldpipe.parallel.runtime import Runtime

pytestmark = pytest.mark.adversarial


class _Loader:
    """The sampler's state holder: a stand-in, the test is about choosing and loading the checkpoint."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _checkpointer(root: Path, width: int = 16) -> Checkpointer:
    """The trainer's Checkpointer (one process) over a fresh model of the given width."""
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3))
    components = TrainingComponents(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, _Loader(),
                                    Progress(), {"run": "loadable"})
    cfg = {"dir": str(root), "keep_last": 5, "keep_every": None, "async_save": False, "verify": "first"}
    return Checkpointer(cfg, Runtime(0, 1, 0, torch.device("cpu")), components)


def _save(root: Path, steps, width: int = 16) -> dict[int, str]:
    """Train one step before each save; returns each step's digest as published."""
    checkpointer = _checkpointer(root, width)
    model, optimizer = checkpointer.components.model, checkpointer.components.optimizer
    digests = {}
    for step in steps:
        model(torch.randn(4, width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpointer.components.progress.step = step
        digests[step] = checkpointer.save(step, final=False)
    checkpointer.close()
    return digests


def _resume_like_training(root: Path) -> int | None:
    """The step training resumes from (and loads): the trainer's Checkpointer on a fresh model."""
    resumed = _checkpointer(root).resume(lambda *_: None)
    return None if resumed is None else resumed.step


def _verify(capsys, root: Path) -> tuple[int, str]:
    rc = cli(["ckpt", "verify", str(root)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_sliced_tensors_with_a_rehashed_manifest_do_not_verify_and_are_skipped(tmp_path, capsys, caplog):
    root = tmp_path / "checkpoints"
    digests = _save(root, [10, 20])
    slice_model_file(root / "step-000020")
    rehash_step(root / "step-000020")  # every sha256 matches: only the shapes tell

    rc, out = _verify(capsys, root)
    assert rc == 1 and "step 10: ok" in out and "step 20: FAILED" in out
    assert "step-000020/model.pt: 0.weight: shape [8, 16] float32 where the manifest records [16, 16] float32" in out

    with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
        digest = checkpoint_digest(root)
    assert digest == digests[10]
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "step-000020" in skipped[0] and "\n" not in skipped[0]
    assert _resume_like_training(root) == 10
    with pytest.raises(CheckpointCorruptError, match="model.pt: 0.weight"):
        CheckpointManager(root).load(20)


def test_training_skips_a_step_that_does_not_fit_its_model(tmp_path, caplog):
    """A step saved by a different model (no forgery: its manifest is right) is not loadable into this one."""
    root = tmp_path / "checkpoints"
    _save(root, [10])
    _save(root, [20], width=8)
    assert CheckpointManager(root, verify="sha256").verify(20) == []
    with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
        assert _resume_like_training(root) == 10
    assert any("step-000020" in r.getMessage() and "in the model being loaded" in r.getMessage()
               for r in caplog.records)


def test_a_symlink_leaving_the_step_is_never_followed(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    digests = _save(root, [10, 20])
    outside = tmp_path / "elsewhere.pt"
    os.replace(root / "step-000020" / "model.pt", outside)
    (root / "step-000020" / "model.pt").symlink_to(outside)
    rehash_step(root / "step-000020")

    rc, out = _verify(capsys, root)
    assert rc == 1 and "step 20: FAILED" in out
    assert "step-000020/model.pt" in out and "resolves outside its step directory" in out
    assert _resume_like_training(root) == 10
    assert checkpoint_digest(root) == digests[10]


def test_a_symlink_inside_the_step_is_fine(tmp_path):
    root = tmp_path / "checkpoints"
    digests = _save(root, [10])
    step_dir = root / "step-000010"
    os.replace(step_dir / "model.pt", step_dir / "model.real.pt")
    (step_dir / "model.pt").symlink_to("model.real.pt")
    assert checkpoint_digest(root) == digests[10]


def test_verify_of_a_directory_without_checkpoints_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for target, text in ((tmp_path / "empty", "no checkpoints"), (tmp_path / "missing", "no such directory")):
        rc, out = _verify(capsys, target)
        assert rc == 2  # RUN names no checkpoint: bad input
        lines = out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0] and str(target) in lines[0]


def test_digest_of_a_run_with_nothing_loadable_is_one_error(tmp_path, capsys, caplog):
    root = tmp_path / "checkpoints"
    _save(root, [10])
    slice_model_file(root / "step-000010")
    rehash_step(root / "step-000010")
    with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
        rc = cli(["ckpt", "digest", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2  # RUN names no loadable checkpoint: bad input, as `serve` says too
    assert len(err) == 1 and err[0].startswith("error: ") and "no loadable checkpoint" in err[0]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"skipping checkpoint {root}/step-000010"]


def test_an_old_manifest_without_a_tensor_table_still_loads(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [10])
    manifest = root / "step-000010" / "MANIFEST.json"
    body = json.loads(manifest.read_text())
    del body["tensors"]
    manifest.write_text(json.dumps(body))
    rehash_step(root / "step-000010")
    assert CheckpointManager(root, verify="sha256").latest_loadable() == 10

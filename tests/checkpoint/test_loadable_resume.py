"""Issue 19, cases 1-4 on real training runs (torchrun, 2 gloo ranks): a newest step whose every checksum matches
but which would not load is skipped by name, and training, `ckpt digest`, the rollout service and evaluation
all take the step before it; the resumed run ends with the uninterrupted run's digest.

Full checkpoints (DDP): model.pt re-saved with sliced tensors and the manifest re-hashed. Sharded checkpoints
(FSDP2): an index with overlapping pieces, an index whose shape disagrees with the model, a shard holding a
pickle with code, an index piece naming the previous step's shard file - each re-hashed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from checkpoint_states import rehash_step, slice_model_file
from smoke_runs import run_train
from worldpipe.checkpoint import checkpoint_digest
from worldpipe.checkpoint.shards import INDEX_FILE, shard_file
from worldpipe.evaluate.open_loop import load_model
from worldpipe.rollout.registry import ModelRegistry

pytestmark = [pytest.mark.crash, pytest.mark.slow]


def _resume(run_dir: Path, dataset, env, *extra) -> str:
    """Resume the run; returns the step it says it resumed from (and asserts it finished)."""
    (run_dir / "train_done.json").unlink(missing_ok=True)
    proc = run_train(run_dir, dataset, env, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    skipped = [line for line in output.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and "step-000030" in skipped[0], output[-3000:]
    return re.search(r"resumed from \S+ step (\d+)", output)[1]


def test_full_checkpoint_with_sliced_tensors_every_reader_takes_the_step_before(tmp_path, smoke_runs, smoke_dataset,
                                                                                 env_with_venv):
    run_dir = smoke_runs.copy(smoke_runs.straight("parallel.nproc_per_node=2"), tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    final, before = checkpoint_digest(checkpoints), checkpoint_digest(checkpoints, 20)
    slice_model_file(checkpoints / "step-000030")
    rehash_step(checkpoints / "step-000030")

    verify = subprocess.run(["worldpipe", "ckpt", "verify", str(run_dir)], env=env_with_venv, capture_output=True,
                            text=True, timeout=120)
    assert verify.returncode == 1 and "step 20: ok" in verify.stdout and "step 30: FAILED" in verify.stdout
    assert "step-000030/model.pt: obs_mean: shape [1] float32 where the manifest records [3] float32" in verify.stdout
    digest = subprocess.run(["worldpipe", "ckpt", "digest", str(run_dir)], env=env_with_venv, capture_output=True,
                            text=True, timeout=120)
    assert digest.returncode == 0 and digest.stdout.strip() == before
    assert [line for line in digest.stderr.splitlines() if "step-000030" in line][0].count("skipping") == 1

    registry = ModelRegistry(checkpoints)  # what `worldpipe serve` would serve
    registry.refresh()
    assert registry.latest().step == 20
    assert load_model(str(checkpoints))[1]["step"] == 20  # what evaluation would evaluate

    assert _resume(run_dir, smoke_dataset, env_with_venv) == "20"
    assert checkpoint_digest(checkpoints) == final


def _index(step_dir: Path) -> dict:
    return json.loads((step_dir / INDEX_FILE).read_text())


def _write_index(step_dir: Path, index: dict) -> None:
    (step_dir / INDEX_FILE).write_text(json.dumps(index))


def _overlap(step_dir: Path) -> None:
    index = _index(step_dir)
    entry = next(e for e in index["tensors"] if len(e["pieces"]) == 2)
    entry["pieces"][1]["offset"] = entry["pieces"][0]["offset"]  # as many elements, half of them twice
    _write_index(step_dir, index)


def _wrong_shape(step_dir: Path) -> None:
    index = _index(step_dir)
    entry = next(e for e in index["tensors"] if e["path"][0] == "model" and len(e["shape"]) == 2)
    entry["shape"][0] *= 2
    _write_index(step_dir, index)


class Payload:
    """A pickled object of a class that `torch.load(weights_only=True)` rightly refuses to build."""


def _pickle(step_dir: Path) -> None:
    torch.save({"0": Payload()}, step_dir / shard_file(1))


def _escape(step_dir: Path) -> None:
    index = _index(step_dir)
    for entry in index["tensors"]:
        for piece in entry["pieces"]:
            if piece["file"] == shard_file(1):
                piece["file"] = f"../step-000020/{shard_file(1)}"
    _write_index(step_dir, index)


def test_sharded_checkpoint_forgeries_fall_back_and_resume_to_the_same_bits(tmp_path, smoke_runs, smoke_dataset,
                                                                            env_with_venv):
    run_dir = smoke_runs.copy(smoke_runs.straight("parallel=fsdp2"), tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    final = checkpoint_digest(checkpoints)
    for damage in (_overlap, _wrong_shape, _pickle, _escape):
        damage(checkpoints / "step-000030")
        rehash_step(checkpoints / "step-000030")
        assert _resume(run_dir, smoke_dataset, env_with_venv, "parallel=fsdp2") == "20", damage.__name__
        assert checkpoint_digest(checkpoints) == final, damage.__name__

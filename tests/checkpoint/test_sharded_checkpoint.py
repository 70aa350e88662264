"""Sharded checkpoints on real process groups (gloo): every rank writes its own pieces, rank 0 commits.

Resharding: one trajectory is trained across layouts and world sizes (fsdp 4 → fsdp 2 → single 1 → fsdp 4 →
ddp 2 → fsdp 2), resuming each leg from the previous leg's sharded checkpoint, and must end within float
tolerance of the same training run uninterrupted on one process (reduction order differs between world
sizes: rtol 1e-5, atol 1e-6 after 12 Adam steps). Digest: the same state saved sharded and gathered has the
same digest (also when saved in the background while training goes on), and `worldpipe ckpt
list|verify|digest` read the sharded one. Memory: rank 0's peak RSS during a
sharded save stays below the full state's size (it does during a gathered save).

The training legs run on ranks forked from the test (sharded_support.on_forked_ranks: 11 legs of 1-4 ranks
cost their steps, not a torchrun start-up each); the memory test measures a rank started by torchrun.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from sharded_support import on_forked_ranks, torchrun
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.shards import CONTENTS_KEY, INDEX_FILE
from worldpipe.cli import main as cli_main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def _params(path: Path) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in json.loads(path.read_text())["model"].items()}


def test_resume_across_layouts_and_world_sizes(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out.json"
    reference = tmp_path / "reference.json"
    on_forked_ranks(1, "train", tmp_path / "ref", reference, "--layout", "single", "--steps", 12, tmp=tmp_path)
    legs = [(4, "fsdp2", None, 2), (2, "fsdp2", 2, 4), (1, "single", 4, 6), (4, "fsdp2", 6, 8), (2, "ddp", 8, 10),
            (2, "fsdp2", 10, 12)]
    for nproc, layout, start, stop in legs:
        args = ["train", root, out, "--layout", layout, "--steps", stop, "--save-at", stop]
        if start is not None:
            args += ["--resume-step", start]
        on_forked_ranks(nproc, *args, tmp=tmp_path)
        result = json.loads(out.read_text())
        assert result["step"] == stop
        if start is not None:  # the sampler resumes where the saving run left it
            assert result["resumed_sampler"] == {"cursor": start * 8}
    cm = CheckpointManager(root, verify="sha256")
    for step in (10, 12):
        assert cm.verify(step) == []
    contents = json.loads((root / "step-000012" / "MANIFEST.json").read_text())["contents"]
    assert contents[CONTENTS_KEY]["files"] == ["shards/rank-00000.pt", "shards/rank-00001.pt"]
    final, ref = _params(out), _params(reference)
    assert sorted(final) == sorted(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
    # Loaded on one process, the sharded checkpoint is the whole logical state.
    loaded = cm.load(12)
    for name, tensor in ref.items():
        torch.testing.assert_close(loaded["model"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sharded_and_gathered_saves_have_one_digest_and_cli_reads_them(mode, tmp_path, capsys):
    sharded, full = tmp_path / "sharded", tmp_path / "full"
    extra = ["--async-save"] if mode == "async" else []  # async: the copy overlaps the next step's forward
    on_forked_ranks(3, "train", sharded, tmp_path / "a.json", "--steps", 3, "--save-at", "1,2", *extra, tmp=tmp_path)
    on_forked_ranks(3, "train", full, tmp_path / "b.json", "--steps", 3, "--save-at", "1,2", "--full", tmp=tmp_path)
    assert (sharded / "step-000002" / INDEX_FILE).is_file()
    assert not (full / "step-000002" / INDEX_FILE).exists()
    for step in (1, 2):
        assert checkpoint_digest(sharded, step) == checkpoint_digest(full, step)
    assert checkpoint_digest(sharded, 1) != checkpoint_digest(sharded, 2)
    for cmd in (["list"], ["verify"], ["digest"]):  # the CLI's commands, in this process (no interpreter start-up)
        assert cli_main(["ckpt", *cmd, str(tmp_path / "sharded")]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out.strip()
    assert printed == checkpoint_digest(full, 2)


def test_rank0_peak_memory_during_sharded_save_stays_below_full_state(tmp_path, env_with_venv):
    out = tmp_path / "memory.json"
    # width 1024: ~2.1 M parameters, 25 MB of parameters + Adam state, 6 MB per rank on 4 ranks
    # A fixed mmap threshold: glibc otherwise raises it after frees and serves big tensors from heap memory
    # already counted in the baseline RSS, which would hide allocations from the high-water mark.
    _ok(torchrun(env_with_venv, 4, "memory", tmp_path / "ckpt", out, "--width", 1024,
                 extra_env={"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}))
    result = json.loads(out.read_text())
    full, shard = result["full_state_bytes"], result["rank0_shard_bytes"]
    assert full > 3 * shard  # the state is several times one shard
    peaks = result["peak_bytes"]
    assert peaks["sharded"] < full, result
    # The measurement can see a gathered state: the unsharded save does exceed the full state's size.
    assert peaks["full"] > full, result

"""FSDP2 (fully_shard) on 2 gloo ranks: trains, checkpoints full state, resumes bit-exactly, agrees with DDP."""

import pytest
import torch

from kill_support import assert_died_of_sigkill
from smoke_runs import run_train
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fsdp2_resume_is_bit_exact_and_matches_ddp(tmp_path, smoke_runs, smoke_dataset, env_with_venv):
    # The uninterrupted FSDP2 and DDP runs are the session's shared smoke runs (tests/smoke_runs.py).
    straight = smoke_runs.straight("parallel=fsdp2").dir
    died = smoke_runs.killed("after_latest@20:die", "parallel=fsdp2")
    assert_died_of_sigkill(died.proc, died.dir)  # every rank dies at after_latest of step 20
    interrupted = smoke_runs.copy(died, tmp_path / "interrupted")
    assert CheckpointManager(interrupted / "checkpoints").latest_intact() == 20
    resumed = run_train(interrupted, smoke_dataset, env_with_venv, "parallel=fsdp2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_digest(interrupted / "checkpoints") == checkpoint_digest(straight / "checkpoints")

    ddp = smoke_runs.straight("parallel.nproc_per_node=2").dir
    sharded = CheckpointManager(straight / "checkpoints").load()["model"]
    replicated = CheckpointManager(ddp / "checkpoints").load()["model"]
    assert sorted(sharded) == sorted(replicated)
    for name, tensor in replicated.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-6)

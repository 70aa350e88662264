"""FSDP2 (fully_shard) on 2 gloo ranks: trains, checkpoints full state, resumes bit-exactly, agrees with DDP."""

import pytest
import torch
from kill_support import assert_died_of_sigkill

from worldpipe.checkpoint import CheckpointManager, checkpoint_digest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fsdp2_resume_is_bit_exact_and_matches_ddp(tmp_path, smoke_dataset, env_with_venv):
    from test_train_recovery import run_train  # same command line as the crash tests

    straight, interrupted, ddp = tmp_path / "straight", tmp_path / "interrupted", tmp_path / "ddp"
    assert run_train(straight, smoke_dataset, env_with_venv, "parallel=fsdp2").returncode == 0
    died = run_train(interrupted, smoke_dataset, env_with_venv, "parallel=fsdp2", fault="after_latest@20:die")
    assert_died_of_sigkill(died, interrupted)  # every rank dies at after_latest of step 20
    assert CheckpointManager(interrupted / "checkpoints").latest_intact() == 20
    resumed = run_train(interrupted, smoke_dataset, env_with_venv, "parallel=fsdp2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_digest(interrupted / "checkpoints") == checkpoint_digest(straight / "checkpoints")

    assert run_train(ddp, smoke_dataset, env_with_venv).returncode == 0
    sharded = CheckpointManager(straight / "checkpoints").load()["model"]
    replicated = CheckpointManager(ddp / "checkpoints").load()["model"]
    assert sorted(sharded) == sorted(replicated)
    for name, tensor in replicated.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-6)

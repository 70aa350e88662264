"""The trainer saves DTensor-sharded runs (FSDP2, TP) sharded (no rank gathers), sync or async, and resumes them
onto other layouts (DDP, FSDP2).

Real torchrun (2 gloo ranks) through `worldpipe.trainer.main`: an FSDP2 run saving asynchronously (the snapshot copy
overlapping the next step) ends with the digest of the same run saving synchronously; both checkpoints are
sharded; a DDP run resumed from the FSDP2 run's sharded checkpoint of an earlier step finishes. A tensor-
parallel transformer run killed after step 20 resumes bit-exactly, and its step-20 checkpoint resumes on FSDP2.
"""

import json
import shutil

import pytest
from kill_support import assert_died_of_sigkill
from test_train_recovery import run_train

from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.shards import INDEX_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fsdp2_async_sharded_saves_match_sync_and_resume_on_ddp(tmp_path, smoke_dataset, env_with_venv):
    sync, background, ddp = tmp_path / "sync", tmp_path / "async", tmp_path / "ddp"
    proc = run_train(sync, smoke_dataset, env_with_venv, "parallel=fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(background, smoke_dataset, env_with_venv, "parallel=fsdp2", "checkpoint.async_save=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in (sync, background):
        cm = CheckpointManager(run / "checkpoints", verify="sha256")
        steps = [i.step for i in cm.list()]
        assert steps and all(cm.verify(s) == [] for s in steps)
        assert all((run / "checkpoints" / f"step-{s:06d}" / INDEX_FILE).is_file() for s in steps)
    assert checkpoint_digest(background / "checkpoints") == checkpoint_digest(sync / "checkpoints")
    done = json.loads((background / "train_done.json").read_text())
    assert done["digest"] == checkpoint_digest(sync / "checkpoints")

    # Resume the FSDP2 run's earlier sharded checkpoint on DDP (a different layout).
    first = min(i.step for i in CheckpointManager(sync / "checkpoints").list())
    (ddp / "checkpoints").mkdir(parents=True)
    shutil.copytree(sync / "checkpoints" / f"step-{first:06d}", ddp / "checkpoints" / f"step-{first:06d}")
    proc = run_train(ddp, smoke_dataset, env_with_venv, "parallel=ddp",
                     "checkpoint.allow_config_change=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ddp / "train_done.json").read_text())["final_step"] > first


def test_tensor_parallel_run_resumes_bit_exact_and_onto_fsdp2(tmp_path, smoke_dataset, env_with_venv):
    """TP (DTensor column/row-wise shards) is saved sharded too; killed after step 20 it resumes to the
    uninterrupted run's digest, and its step-20 checkpoint resumes on FSDP2 (another layout)."""
    straight, interrupted, fsdp = tmp_path / "straight", tmp_path / "interrupted", tmp_path / "fsdp"
    tp = ["experiment=smoke_transformer", "parallel=tp"]
    proc = run_train(straight, smoke_dataset, env_with_venv, *tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    died = run_train(interrupted, smoke_dataset, env_with_venv, *tp, fault="after_latest@20:die")
    assert_died_of_sigkill(died, interrupted)  # every rank dies at after_latest of step 20
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step-000020"
    assert (interrupted / "checkpoints" / "step-000020" / INDEX_FILE).is_file()
    (fsdp / "checkpoints").mkdir(parents=True)
    shutil.copytree(interrupted / "checkpoints" / "step-000020", fsdp / "checkpoints" / "step-000020")
    proc = run_train(interrupted, smoke_dataset, env_with_venv, *tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_digest(interrupted / "checkpoints") == checkpoint_digest(straight / "checkpoints")

    proc = run_train(fsdp, smoke_dataset, env_with_venv, "experiment=smoke_transformer", "parallel=fsdp2",
                     "checkpoint.allow_config_change=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((fsdp / "train_done.json").read_text())["final_step"] == 30

"""The trainer saves DTensor-sharded runs (FSDP2, TP) sharded (no rank gathers), sync or async, and resumes them
onto other layouts (DDP, FSDP2).

2 gloo ranks through `worldpipe.trainer.main`: an FSDP2 run saving asynchronously (the snapshot copy
overlapping the next step) ends with the digest of the same run saving synchronously; both checkpoints are
sharded; a DDP run resumed from the FSDP2 run's sharded checkpoint of an earlier step finishes. A tensor-
parallel transformer run killed after step 20 resumes bit-exactly, and its step-20 checkpoint resumes on FSDP2.

The killed run and its resume are real `worldpipe train` (torchrun); the other runs train on ranks forked from
the test (tests/forked_ranks.py, the same checks and worker body without a torchrun start-up), the synchronous
FSDP2 run being the session's shared one (tests/smoke_runs.py).
"""

import json
import shutil

import pytest

from forked_ranks import train_on_ranks
from kill_support import assert_died_of_sigkill
from smoke_runs import run_train, train_cmd
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.shards import INDEX_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def on_forked_ranks(run_dir, dataset, *extra: str) -> dict:
    """The crash tests' `worldpipe train` command (tests/smoke_runs.py) on forked ranks; the completion record."""
    return train_on_ranks(train_cmd(run_dir, dataset, *extra)[2:], tmp=run_dir.parent / f"{run_dir.name}-ranks")


def test_fsdp2_async_sharded_saves_match_sync_and_resume_on_ddp(tmp_path, smoke_runs, smoke_dataset):
    sync = smoke_runs.straight("parallel=fsdp2").dir  # shared (tests/smoke_runs.py): read only
    background, ddp = tmp_path / "async", tmp_path / "ddp"
    on_forked_ranks(background, smoke_dataset, "parallel=fsdp2", "checkpoint.async_save=true")
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
    done = on_forked_ranks(ddp, smoke_dataset, "parallel=ddp", "checkpoint.allow_config_change=true")
    assert done["final_step"] > first


def test_tensor_parallel_run_resumes_bit_exact_and_onto_fsdp2(tmp_path, smoke_dataset, env_with_venv):
    """TP (DTensor column/row-wise shards) is saved sharded too; killed after step 20 it resumes to the
    uninterrupted run's digest, and its step-20 checkpoint resumes on FSDP2 (another layout)."""
    straight, interrupted, fsdp = tmp_path / "straight", tmp_path / "interrupted", tmp_path / "fsdp"
    tp = ["experiment=smoke_transformer", "parallel=tp"]
    on_forked_ranks(straight, smoke_dataset, *tp)
    died = run_train(interrupted, smoke_dataset, env_with_venv, *tp, fault="after_latest@20:die")
    assert_died_of_sigkill(died, interrupted)  # every rank dies at after_latest of step 20
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step-000020"
    assert (interrupted / "checkpoints" / "step-000020" / INDEX_FILE).is_file()
    (fsdp / "checkpoints").mkdir(parents=True)
    shutil.copytree(interrupted / "checkpoints" / "step-000020", fsdp / "checkpoints" / "step-000020")
    proc = run_train(interrupted, smoke_dataset, env_with_venv, *tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_digest(interrupted / "checkpoints") == checkpoint_digest(straight / "checkpoints")

    done = on_forked_ranks(fsdp, smoke_dataset, "experiment=smoke_transformer", "parallel=fsdp2",
                           "checkpoint.allow_config_change=true")
    assert done["final_step"] == 30

"""Sharded checkpoints in one process (a one-rank gloo group, FSDP2): format, damage, faults, object stores.

The multi-rank behaviour (resharding across world sizes, SIGKILL of a rank, memory) is tested under torchrun
in tests/checkpoint/test_sharded_checkpoint.py and tests/checkpoint/test_sharded_crash.py.
"""

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from checkpoint_states import flip_byte
from sharded_support import fsdp_toy_model
from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError, checkpoint_digest
from worldpipe.checkpoint.resharding import load_resharded
from worldpipe.checkpoint.sharded_saver import ShardedSaver
from worldpipe.checkpoint.shards import INDEX_FILE, shard_file


def _state(model, opt, step: int = 1) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
            "scheduler": None, "scaler": None, "ema": None,
            "progress": {"step": step, "epoch": 0, "samples_seen": 4, "tokens_seen": 0},
            "sampler": {"cursor": 4}, "rng": [], "identity": {"run": "t"}}


def test_sharded_save_loads_back_and_damage_is_named(one_rank_group, tmp_path, env_with_venv):
    model, opt = fsdp_toy_model()
    cm = CheckpointManager(tmp_path / "ck")
    ShardedSaver(cm).save(1, _state(model, opt))
    assert cm.verify(1) == []
    manifest = json.loads((tmp_path / "ck" / "step-000001" / "MANIFEST.json").read_text())
    assert {shard_file(0), INDEX_FILE} <= {f["path"] for f in manifest["files"]}
    expected = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    fresh, fresh_opt = fsdp_toy_model(seed=1)
    rest = load_resharded(cm, 1, fresh, fresh_opt)
    assert rest["progress"]["step"] == 1 and rest["sampler"] == {"cursor": 4}
    for name, tensor in get_model_state_dict(fresh).items():
        assert torch.equal(tensor.full_tensor(), expected[name])
    assert checkpoint_digest(tmp_path / "ck") == checkpoint_digest(tmp_path / "ck", 1)

    flip_byte(tmp_path / "ck" / "step-000001" / shard_file(0))
    problems = CheckpointManager(tmp_path / "ck").verify(1)
    assert len(problems) == 1 and problems[0].startswith(f"step-000001/{shard_file(0)}: sha256")
    proc = subprocess.run([sys.executable, "-m", "worldpipe.cli", "ckpt", "verify", str(tmp_path / "ck")],
                          env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and shard_file(0) in proc.stdout


def test_fault_on_another_rank_does_not_fire_and_on_this_rank_keeps_previous(one_rank_group, tmp_path,
                                                                                monkeypatch):
    model, opt = fsdp_toy_model()
    cm = CheckpointManager(tmp_path / "ck", keep_last=2)
    saver = ShardedSaver(cm)
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files@1#1:raise")  # rank 1: not this process
    saver.save(1, _state(model, opt, 1))
    monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files@2#0:raise")
    with pytest.raises(CheckpointWriteError, match="step 2"):
        saver.save(2, _state(model, opt, 2))
    assert [(i.step, i.intact, i.is_latest) for i in cm.list()] == [(1, True, True)]
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".step-")]


def test_sharded_save_on_an_object_store_commits_with_the_manifest(one_rank_group):
    model, opt = fsdp_toy_model()
    cm = CheckpointManager("memory://sharded-test/ck")
    background = ShardedSaver(cm, async_save=True)
    background.save(3, _state(model, opt, 3), opt)
    opt.step()  # the step pre-hook waits for the snapshot copy
    cm.wait()
    ShardedSaver(cm).save(4, _state(model, opt, 4))
    assert [i.step for i in cm.list()] == [3, 4]
    assert cm.verify(3) == [] and cm.verify(4) == []
    fresh, fresh_opt = fsdp_toy_model(seed=2)
    load_resharded(cm, 4, fresh, fresh_opt)
    for (name, a), b in zip(get_model_state_dict(model).items(), get_model_state_dict(fresh).values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name

"""SIGKILL of one rank during a sharded save (real torchrun, gloo): the previous checkpoint stays `latest`.

Two FSDP2 ranks save step 2, then die while saving step 4: rank 1 half-way through writing its shard file
(`mid_files@4#1:die`), or rank 0 after every shard file is durable but before the manifest
(`after_files@4#0:die`), or rank 0 with the manifest written but the directory not yet renamed. torchrun then
tears the other rank down. Afterwards step 2 is `latest`, verifies by sha256, has the digest of the same step
saved without a fault (sync or async saves alike), the half-written step is only a hidden partial directory, and a resumed run publishes
step 4 and removes it.
"""

from __future__ import annotations

import json
import os

import pytest

from kill_support import assert_died_of_sigkill
from sharded_support import torchrun
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory, env_with_venv) -> str:
    root = tmp_path_factory.mktemp("clean") / "ckpt"
    proc = torchrun(env_with_venv, 2, "train", root, root.parent / "out.json", "--steps", 2, "--save-at", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return checkpoint_digest(root, 2)


@pytest.mark.parametrize(("fault", "mode"), [("mid_files@4#1:die", "sync"), ("after_files@4#0:die", "sync"),
                                           ("after_manifest@4#0:die", "sync"), ("mid_files@4#1:die", "async"),
                                           ("after_files@4#0:die", "async")])
def test_rank_killed_during_sharded_save_leaves_previous_latest_intact(fault, mode, tmp_path, env_with_venv,
                                                                        clean_digest):
    root = tmp_path / "ckpt"
    extra = ["--async-save"] if mode == "async" else []
    died = torchrun(env_with_venv, 2, "train", root, tmp_path / "out.json", "--steps", 4, "--save-at", "2,4",
                    *extra, fault=fault)
    assert_died_of_sigkill(died, rank=int(fault.split("#")[1].split(":")[0]))  # the faulted rank, killed
    assert not (tmp_path / "out.json").exists()
    assert (root / "latest").read_text().strip() == "step-000002"
    cm = CheckpointManager(root, verify="sha256")
    assert [(i.step, i.intact) for i in cm.list()] == [(2, True)]
    assert cm.verify(2) == []
    assert cm.latest_intact() == 2
    assert checkpoint_digest(root, 2) == clean_digest
    leftovers = [n for n in os.listdir(root) if n.startswith(".step-000004.partial-")]
    assert len(leftovers) == 1, os.listdir(root)

    resumed = torchrun(env_with_venv, 2, "train", root, tmp_path / "out.json", "--resume-step", 2, "--steps", 4,
                       "--save-at", 4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())["step"] == 4
    assert cm.latest_intact() == 4 and cm.verify(4) == []
    assert not [n for n in os.listdir(root) if n.startswith(".step-")]

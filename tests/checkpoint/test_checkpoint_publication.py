"""One publication protocol (worldpipe.checkpoint.publication) for full and sharded saves, in every store.

A full save (CheckpointManager) and a sharded one (ShardedSaver, FSDP2 on a one-rank gloo group) pass the same
fault phases in the same order, readers see the same steps and the same `latest` at each, and a failure at any
phase before the commit leaves the same result: the previous checkpoint `latest`, nothing of the new step.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import fsspec
import pytest
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from checkpoint_states import example_state
from sharded_support import fsdp_toy_model
from worldpipe.checkpoint import CheckpointManager, CheckpointWriteError
from worldpipe.checkpoint.fault import PHASES, hooked
from worldpipe.checkpoint.sharded_saver import ShardedSaver

BEFORE_COMMIT = PHASES[:PHASES.index("after_rename")]
SEEN_BEFORE = ([1, 2], 2)
# What a reader sees at each phase of saving step 3 (keep_last=2: step 1 goes after `latest` names step 3).
# An object store has no rename: its manifest is the commit, so step 3 is visible from `after_manifest` on.
EXPECTED = {store: {**dict.fromkeys(BEFORE_COMMIT, SEEN_BEFORE), "after_rename": ([1, 2, 3], 2),
                    "after_latest": ([1, 2, 3], 3), "before_retention": ([1, 2, 3], 3),
                    "after_retention": ([2, 3], 3)} for store in ("posix", "memory")}
EXPECTED["memory"]["after_manifest"] = ([1, 2, 3], 2)


def _root(store: str, tmp_path, kind: str) -> str:
    return str(tmp_path / kind) if store == "posix" else f"memory://publication-{uuid.uuid4().hex}/{kind}"


def _saver(root: str, kind: str):
    """save(step) for a full or a sharded save into ``root``."""
    manager = CheckpointManager(root, keep_last=2)
    if kind == "full":
        return lambda step: manager.save(step, example_state(seed=step))
    model, opt = fsdp_toy_model()
    sharded = ShardedSaver(manager)
    return lambda step: sharded.save(step, {**example_state(seed=step), "model": get_model_state_dict(model),
                                            "optimizer": get_optimizer_state_dict(model, opt)})


def _seen(root: str) -> tuple[list[int], int | None]:
    manager = CheckpointManager(root)
    return [i.step for i in manager.list()], manager.store.read_latest()


def _debris(root: str, step: int) -> list[str]:
    if root.startswith("memory://"):
        fs = fsspec.filesystem("memory")
        base = root.removeprefix("memory://")
        return [p for p in fs.ls(base, detail=False) if f"step-{step:06d}" in p]
    return [n for n in os.listdir(root) if n.startswith(".step-")]


@pytest.mark.parametrize("store", ["posix", "memory"])
def test_full_and_sharded_saves_pass_the_same_phases_seen_the_same_way(one_rank_group, tmp_path, store):
    seen: dict[str, list] = {}
    for kind in ("full", "sharded"):
        root = _root(store, tmp_path, kind)
        save = _saver(root, kind)
        save(1)
        save(2)
        phases: list = []
        with contextlib.ExitStack() as hooks:
            for phase in PHASES:
                hooks.enter_context(hooked(phase, lambda step, phase=phase, root=root, phases=phases:
                                           phases.append((phase, step, _seen(root)))))
            save(3)
        seen[kind] = phases
    expected = [(phase, 3, EXPECTED[store][phase]) for phase in PHASES]
    assert seen["full"] == expected
    assert seen["sharded"] == expected


@pytest.mark.parametrize("store", ["posix", "memory"])
@pytest.mark.parametrize("phase", BEFORE_COMMIT)
def test_a_failure_before_the_commit_leaves_the_same_result_for_full_and_sharded_saves(
        one_rank_group, tmp_path, monkeypatch, store, phase):
    for kind in ("full", "sharded"):
        root = _root(store, tmp_path, kind)
        save = _saver(root, kind)
        save(1)
        monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", f"{phase}@2:raise")
        with pytest.raises(CheckpointWriteError, match="step 2"):
            save(2)
        monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
        assert _seen(root) == ([1], 1), kind
        assert _debris(root, 2) == [], kind
        save(2)  # and the next save publishes normally
        assert _seen(root) == ([1, 2], 2), kind

"""Every `checkpoint.verify` mode, as a resume uses it: choose the newest intact step, then load it.

A resume runs in a fresh process, so nothing is remembered as verified; each test builds fresh managers over a
fresh root (the `first` mode's memory is per root and step). `first` is the default: it must hash a step the
first time it is selected, or a flipped byte in the newest checkpoint would be loaded as if intact.
"""

from __future__ import annotations

import pytest

from checkpoint_states import example_state, flip_byte
from worldpipe.checkpoint import CheckpointManager
from worldpipe.checkpoint.manager import VERIFY_MODES

HASHING_MODES = ("sha256", "first")


def _save_steps(root, steps=(1, 2)) -> None:
    cm = CheckpointManager(root, keep_last=len(steps))
    for step in steps:
        state = example_state(seed=step)
        state["progress"]["step"] = step
        cm.save(step, state)


def _resume(root, mode: str) -> tuple[int, int]:
    """What training does on start (Checkpointer.resume): rank 0 picks the newest step that verifies and
    decodes, every rank loads that step."""
    manager = CheckpointManager(root, verify=mode)
    chosen = manager.latest_loadable()
    assert chosen is not None
    return chosen, manager.load(chosen)["progress"]["step"]


def test_the_modes_are_the_ones_tested():
    assert set(VERIFY_MODES) == {*HASHING_MODES, "size"}


@pytest.mark.parametrize("mode", VERIFY_MODES)
def test_intact_checkpoints_resume_from_the_newest(tmp_path, mode):
    _save_steps(tmp_path / "ck")
    assert _resume(tmp_path / "ck", mode) == (2, 2)


@pytest.mark.parametrize("mode", HASHING_MODES)
@pytest.mark.parametrize("victim", ["model.pt", "optimizer.pt", "rng/rank-00000.pt", "train_state.json"])
def test_flipped_byte_in_the_newest_step_resumes_from_the_previous(tmp_path, mode, victim, caplog):
    _save_steps(tmp_path / "ck")
    flip_byte(tmp_path / "ck" / "step-000002" / victim)
    assert _resume(tmp_path / "ck", mode) == (1, 1)
    assert any("step-000002" in r.getMessage() and victim in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", VERIFY_MODES)
def test_truncated_file_in_the_newest_step_resumes_from_the_previous(tmp_path, mode):
    _save_steps(tmp_path / "ck")
    path = tmp_path / "ck" / "step-000002" / "model.pt"
    path.write_bytes(path.read_bytes()[:-1])
    assert _resume(tmp_path / "ck", mode) == (1, 1)


def test_size_mode_does_not_hash(tmp_path):
    # The documented trade-off of `size`: a flipped byte that keeps every size is not seen at selection.
    _save_steps(tmp_path / "ck")
    flip_byte(tmp_path / "ck" / "step-000002" / "train_state.json", offset=0)
    assert CheckpointManager(tmp_path / "ck", verify="size").latest_intact() == 2
    assert CheckpointManager(tmp_path / "ck", verify="first").latest_intact() == 1


def test_first_hashes_once_then_trusts_sizes(tmp_path):
    _save_steps(tmp_path / "ck")
    manager = CheckpointManager(tmp_path / "ck", verify="first")
    assert _resume(tmp_path / "ck", "first") == (2, 2)  # hashed and remembered for this root and step
    flip_byte(tmp_path / "ck" / "step-000002" / "model.pt")
    assert manager.latest_intact() == 2  # sizes only, as documented: hashing happens once per process
    assert manager.verify(2) != []  # an explicit verify always hashes


def test_size_mode_falls_back_when_the_newest_step_cannot_load(tmp_path):
    _save_steps(tmp_path / "ck")
    flip_byte(tmp_path / "ck" / "step-000002" / "train_state.json", offset=0)  # no longer UTF-8 JSON
    assert _resume(tmp_path / "ck", "size") == (1, 1)

"""Full checkpoints under a simulated power cut: saves recorded once on the crash-simulating file system, then
every state a cut could leave checked with the project's own recovery (``CheckpointManager``): resume never takes
a partial or uncommitted step, never one older than a save reported durable, and what it loads is what was saved.

The default tier sweeps 3 saves; the slow tier 8, with retention deleting steps between them (``keep_every``)."""

from __future__ import annotations

import pytest

from checkpoint_states import example_state
from crashfs.replay import sweep
from worldpipe.checkpoint.digest import state_digest
from worldpipe.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.crash

SIZES = [pytest.param(3, id="3-saves"), pytest.param(8, id="8-saves", marks=pytest.mark.slow)]


def record_saves(crashfs, saves: int, async_save: bool) -> tuple[dict, dict[int, int]]:
    """``saves`` saves into RUN/checkpoints on the mount; the recording and, per step, the log length at which its
    save returned (reported durable)."""
    acked = {}
    with CheckpointManager(crashfs.path / "run" / "checkpoints", keep_last=2, keep_every=4,
                           async_save=async_save) as manager:
        for step in range(1, saves + 1):
            manager.save(step, example_state(seed=step))
            if async_save:
                manager.wait()
            acked[step] = crashfs.length()
    return crashfs.recording(), acked


def check_checkpoints(acked: dict[int, int]):
    """The check of one crash state of RUN (see the module docstring)."""
    expected = {step: state_digest(example_state(seed=step)) for step in acked}

    def check(root, state) -> None:
        durable = [s for s, at in acked.items() if at <= state.done]
        manager = CheckpointManager(root / "checkpoints", keep_last=2, verify="sha256")
        step = manager.latest_loadable()
        if durable:
            assert step is not None, f"step {max(durable)} was reported durable, but no checkpoint loads"
            assert step >= max(durable), f"step {max(durable)} was reported durable, but resume takes step {step}"
        if step is not None:
            assert state_digest(manager.load(step)) == expected[step], f"step {step} loads other state"
        latest = manager.store.read_latest()
        if latest is not None:
            assert manager.verify(latest) == [], f"`latest` names step {latest}, which does not verify"

    return check


@pytest.mark.parametrize("saves", SIZES)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_cut_of_full_saves_resumes_from_a_durable_checkpoint(crashfs, tmp_path, async_save, saves):
    recording, acked = record_saves(crashfs, saves, async_save)
    result = sweep(recording, check_checkpoints(acked), tmp_path, subdir="run")
    print(f"crashfs full checkpoints, {'async' if async_save else 'sync'}, {saves} saves: {result.summary()}")
    assert result.points >= 10 * saves

"""Full checkpoints under a simulated power cut: one run of saves recorded on the crash-simulating file system,
then every state a cut could leave checked with the project's own recovery (``CheckpointManager``)."""

from __future__ import annotations

import pytest

from checkpoint_states import example_state
from crashfs.replay import sweep
from worldpipe.checkpoint.digest import state_digest
from worldpipe.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.crash

STEPS = (1, 2, 3)


def record_saves(crashfs, async_save: bool) -> tuple[dict, dict[int, int]]:
    """Three saves into RUN/checkpoints on the mount; the recording and, per step, the log length at which its
    save returned (reported durable)."""
    acked = {}
    with CheckpointManager(crashfs.path / "run" / "checkpoints", keep_last=2, async_save=async_save) as manager:
        for step in STEPS:
            manager.save(step, example_state(seed=step))
            if async_save:
                manager.wait()
            acked[step] = crashfs.length()
    return crashfs.recording(), acked


def check_checkpoints(acked: dict[int, int]):
    expected = {step: state_digest(example_state(seed=step)) for step in STEPS}

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


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_cut_of_full_saves_resumes_from_a_durable_checkpoint(crashfs, tmp_path, async_save, request):
    recording, acked = record_saves(crashfs, async_save)
    result = sweep(recording, check_checkpoints(acked), tmp_path, subdir="run",
                   sample=None if request.config.getoption("-m") != "not slow" else None)
    print(result.summary())
    assert result.points > 0

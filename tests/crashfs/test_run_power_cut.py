"""Whole training runs under a simulated power cut: the smoke training (30 steps, a checkpoint every 10, 2 gloo
ranks) recorded once on the crash-simulating file system; every state a cut could leave checked with the
project's recovery, and randomly chosen ones resumed as a user would (the same command) to the uninterrupted run's
digest. A live cut (the file system loses power at a random persistence point while the run writes) is remounted
and resumed the same way."""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from crashfs.model import crash_states, write_image
from crashfs.mount import CrashMount
from crashfs.replay import checkpoint_acks, sweep
from forked_ranks import train_on_ranks
from smoke_runs import STEPS, run_train, train_cmd
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.config.paths import COMPLETION_RECORD

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

RESUMED_CUTS = 3


def check_run(acked: dict[int, int], digests: dict[int, str]):
    """A crash state of a run directory: resume takes a step at least as new as every one committed before the
    cut, and that step holds the state the uninterrupted run saved there."""

    def check(run, state) -> None:
        durable = [s for s, at in acked.items() if at <= state.done]
        manager = CheckpointManager(run / "checkpoints", verify="sha256")
        step = manager.latest_loadable()
        if durable:
            assert step is not None and step >= max(durable), (
                f"step {max(durable)} was committed durably, but resume takes {step}")
        if step is not None and step in digests:
            assert checkpoint_digest(run / "checkpoints", step) == digests[step], f"step {step} holds other state"

    return check


def test_random_cuts_of_a_whole_run_resume_to_the_uninterrupted_digest(crashfs, tmp_path, smoke_runs,
                                                                      smoke_dataset):
    reference = checkpoint_digest(smoke_runs.straight().dir / "checkpoints")
    run_dir = crashfs.path / "run"
    train_on_ranks(train_cmd(run_dir, smoke_dataset)[2:], tmp=tmp_path / "ranks")
    assert checkpoint_digest(run_dir / "checkpoints") == reference, "the run on crashfs trained other bits"
    digests = {info.step: checkpoint_digest(run_dir / "checkpoints", info.step)
               for info in CheckpointManager(run_dir / "checkpoints").list()}
    recording = crashfs.recording()
    acked = checkpoint_acks(recording["log"], "run/checkpoints")
    assert sorted(acked) == [10, 20, 30]
    result = sweep(recording, check_run(acked, digests), tmp_path, subdir="run")
    print(f"crashfs whole smoke run (2 ranks, 30 steps): {result.summary()}")

    seed = int.from_bytes(os.urandom(4), "little")
    states = crash_states(recording["initial"], recording["log"])
    for cut in random.Random(seed).sample(states, RESUMED_CUTS):
        where = tmp_path / f"cut-{cut.index}-{cut.kind}"
        write_image(cut.image, where)
        resumed = where / "run"
        train_on_ranks(train_cmd(resumed, smoke_dataset)[2:], tmp=tmp_path / "ranks")
        assert checkpoint_digest(resumed / "checkpoints") == reference, (
            f"seed {seed}: the run cut after operation {cut.index} ({cut.kind}) resumed to other bits")


def test_a_live_power_cut_mid_run_remounts_and_resumes_to_the_uninterrupted_digest(tmp_path, smoke_runs,
                                                                                   smoke_dataset, env_with_venv):
    reference = checkpoint_digest(smoke_runs.straight().dir / "checkpoints")
    seed = int.from_bytes(os.urandom(4), "little")
    cut_after = random.Random(seed).randint(5, 60)
    workdir = tmp_path / "fs"
    with CrashMount(workdir, cut_after=cut_after) as mount:
        killed = run_train(mount.path / "run", smoke_dataset, env_with_venv)
        cut = mount.was_cut
    if cut:
        lines = [line for line in killed.stderr.splitlines() if "Traceback" in line]
        assert not lines or "Input/output error" in killed.stderr, killed.stderr[-2000:]
    with CrashMount(workdir) as mount:  # the next boot: the disk holds what was durable at the cut
        if cut and killed.returncode == 0:
            # Exit 0 promises a finished run: only a cut after its last persistence point may end that way, and
            # then the disk holds its last checkpoint and its completion record.
            run = mount.path / "run"
            assert CheckpointManager(run / "checkpoints", verify="sha256").latest_loadable() == STEPS, (
                f"seed {seed}: the run exited 0 past the power cut at point {cut_after} without its last step durable")
            assert (run / COMPLETION_RECORD).exists(), (
                f"seed {seed}: the run exited 0 past the power cut at point {cut_after} without its completion record")
        resumed = run_train(mount.path / "run", smoke_dataset, env_with_venv)
        assert resumed.returncode == 0, f"seed {seed}, cut after point {cut_after}: {resumed.stderr[-3000:]}"
        assert checkpoint_digest(mount.path / "run" / "checkpoints") == reference, (
            f"seed {seed}: the run cut after persistence point {cut_after} resumed to other bits")
    assert subprocess.run(["mountpoint", "-q", str(workdir / "mnt")]).returncode != 0


def test_a_full_disk_mid_run_stops_it_in_one_line_and_it_resumes_once_there_is_space(crashfs, smoke_runs,
                                                                                     smoke_dataset, env_with_venv):
    reference = checkpoint_digest(smoke_runs.straight().dir / "checkpoints")
    crashfs.faults(space=500_000)  # a smoke checkpoint is ~340 kB: step 10 fits, step 20 does not
    run_dir = crashfs.path / "run"
    full = run_train(run_dir, smoke_dataset, env_with_venv)
    assert full.returncode != 0, "the run went on with a full disk"
    errors = [line for line in full.stderr.splitlines() if "No space left on device" in line]
    assert len(errors) == 1 and "step 20" in errors[0], full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    manager = CheckpointManager(run_dir / "checkpoints", verify="sha256")
    assert manager.latest_loadable() == 10 and manager.store.read_latest() == 10
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if ".partial" in p.name] == []
    crashfs.faults(space=None)
    resumed = run_train(run_dir, smoke_dataset, env_with_venv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_digest(run_dir / "checkpoints") == reference

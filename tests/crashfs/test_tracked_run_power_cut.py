"""A tracked training run under a simulated power cut: the smoke training with its MLflow SQLite store and its
spool both on the crash-simulating file system, recorded once. Every crash state: each checkpoint the spool
reports durable (its ``commit`` record) is there and loads, and the journal is a prefix of the uninterrupted one
(no record lost or changed). A randomly chosen cut is then booted (remounted with what it left) and resumed with
the same command: one MLflow run, finished, whose metric history equals the uninterrupted run's (timing metrics
aside), and the uninterrupted digest."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from crashfs.model import crash_states, write_image
from crashfs.mount import CrashMount
from crashfs.replay import sweep
from tracked_runs import LOG_EVERY, only_run, train_cmd
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.tracking.history import duplicate_steps, first_difference, histories
from worldpipe.tracking.records import TIMING_METRICS
from worldpipe.tracking.spool import Spool

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

RESUMED_CUTS = 1


def train(mount: CrashMount, dataset, env) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(mount.path / "run", dataset, mount.path / "mlflow" / "mlflow.db"), env=env,
                          cwd=mount.path, capture_output=True, text=True, timeout=600)


def read_back(disk, copy) -> tuple[dict, str, list[dict]]:
    """The finished MLflow run's metric histories, the final checkpoint's digest and the journal's records, from
    a copy of ``disk`` (the backing directory of an unmounted crashfs)."""
    shutil.copytree(disk, copy, symlinks=True)
    client, run = only_run(copy / "mlflow" / "mlflow.db")
    assert run.info.status == "FINISHED"
    return (histories(client, run.info.run_id), checkpoint_digest(copy / "run" / "checkpoints"),
            Spool(copy / "run").records())


def test_cuts_of_a_tracked_run_lose_no_durable_record_and_resume_to_the_same_history(tmp_path, smoke_dataset,
                                                                                    env_with_venv):
    workdir = tmp_path / "fs"
    with CrashMount(workdir) as mount:
        done = train(mount, smoke_dataset, env_with_venv)
        assert done.returncode == 0, done.stderr[-3000:]
        recording = mount.recording()
    # Read from a copy of what the disk holds once unmounted: MLflow keeps the store of a URI open, and the
    # mount point's next mount is another file system.
    reference, digest, journal = read_back(workdir / "backing", tmp_path / "reference")
    assert [p[0] for p in reference["loss/total"]] == list(range(LOG_EVERY, 31, LOG_EVERY))

    def check(root, state) -> None:
        records = Spool(root / "run").records()
        assert records == journal[:len(records)], "the journal is not a prefix of the uninterrupted one"
        committed = [r["step"] for r in records if r["op"] == "commit"]
        if committed:
            step = CheckpointManager(root / "run" / "checkpoints", verify="sha256").latest_loadable()
            assert step is not None and step >= max(committed), (
                f"the spool reports step {max(committed)} durable, but resume takes {step}")

    result = sweep(recording, check, tmp_path / "sweep", sample=300)
    print(f"crashfs tracked smoke run (MLflow SQLite and spool): {result.summary()}")

    seed = int.from_bytes(os.urandom(4), "little")
    states = crash_states(recording["initial"], recording["log"])
    for cut in random.Random(seed).sample(states, RESUMED_CUTS):
        shutil.rmtree(workdir / "backing")
        write_image(cut.image, workdir / "backing")  # the disk as the cut left it
        with CrashMount(workdir) as mount:
            resumed = train(mount, smoke_dataset, env_with_venv)
        where = f"seed {seed}: cut after operation {cut.index} ({cut.kind})"
        assert resumed.returncode == 0, f"{where}: {resumed.stderr[-3000:]}"
        got, got_digest, _ = read_back(workdir / "backing", tmp_path / f"cut-{cut.index}")
        assert duplicate_steps(got) == {}, where
        assert set(got) == set(reference), where
        assert first_difference(got, reference, ignore=TIMING_METRICS) is None, where
        assert got_digest == digest, where

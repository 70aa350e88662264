"""Per-rank RNG restore in real training: `experiment=smoke_augmented` draws input augmentation from every
rank's global Python, NumPy and torch generators, so a resume is bit-identical only if each rank gets back
exactly the state it saved (restoring rank 0's state everywhere must fail these tests).

The default-tier test runs the Trainer and its Checkpointer on 2 ranks of a real gloo group forked from the
test (seconds); the slow ones kill a real `worldpipe train` (torchrun, 2 gloo ranks) with SIGKILL at random
points and compare the resumed run's final checkpoint, RNG files included, with an uninterrupted run's (trained
on forked ranks).
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_states import example_state
from forked_ranks import run_on_ranks, train_on_ranks
from kill_support import kill_at_random_point
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.state import capture_rng, rng_fingerprint
from worldpipe.cli import main as cli_main
from worldpipe.launch.preflight import compose_config
from worldpipe.parallel.runtime import init_runtime
from worldpipe.trainer.seeding import PER_RANK_STREAMS
from worldpipe.trainer.trainer import Trainer

pytestmark = [pytest.mark.crash, pytest.mark.integration]

RANKS = 2
TRACED_STREAMS = ("python", "numpy_global", "torch")  # the global generators the augmentation draws from


def train_cmd(run_dir: Path, dataset, steps: int, every: int, *extra: str) -> list[str]:
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke_augmented", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false",
            f"trainer.steps={steps}", f"trainer.log_every={every}", f"checkpoint.every={every}",
            f"parallel.nproc_per_node={RANKS}", *extra]


def run(cmd: list[str], env: dict, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True, timeout=300)


def saved_fingerprints(run_dir: Path, step: int) -> list[dict]:
    rng = CheckpointManager(run_dir / "checkpoints").load(step, keys=["rng"])["rng"]
    return [{k: rng_fingerprint(r)[k] for k in TRACED_STREAMS} for r in rng]


def train_then_resume_in_process(cfg) -> dict:
    """On one rank of a real process group: train 2 steps (step 2 saved), move every generator on, then set up a
    new Trainer as a restarted process does (which seeds the generators afresh) and resume it. Returns the
    fingerprints of the global generators right after the save, after the new setup and after its resume."""
    runtime = init_runtime(cfg.parallel.backend)
    Trainer(cfg, runtime).fit()
    after_save = rng_fingerprint(capture_rng())
    random.random(), np.random.random(), torch.rand(1)  # what the lost process drew after the save
    restarted = Trainer(cfg, runtime)
    restarted.setup()
    seeded = rng_fingerprint(capture_rng())
    restarted.resume()
    restored = rng_fingerprint(capture_rng())
    return {name: {k: fp[k] for k in TRACED_STREAMS} for name, fp in
            (("after_save", after_save), ("seeded", seeded), ("restored", restored))}


def test_each_rank_gets_back_the_rng_state_it_saved(tmp_path, smoke_dataset, capsys):
    """The Trainer and its Checkpointer on 2 ranks of a real gloo group (forked from the test): each rank saves
    its own RNG state and, in a restarted Trainer, gets exactly that state back, not rank 0's (the ranks'
    states differ) and not the fresh seeding (the resume changes it)."""
    run_dir = tmp_path / "run"
    store, manifest = smoke_dataset
    cfg = compose_config(["experiment=smoke_augmented", f"run_dir={run_dir}", f"data.store={store}",
                          f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false",
                          "trainer.steps=2", "trainer.log_every=2", "checkpoint.every=2", "data.prefetch=0",
                          f"parallel.nproc_per_node={RANKS}"])
    results = run_on_ranks(RANKS, train_then_resume_in_process, cfg, tmp=tmp_path)

    saved = saved_fingerprints(run_dir, 2)
    assert len(saved) == RANKS
    for stream in PER_RANK_STREAMS:  # otherwise restoring rank 0's state everywhere would go unnoticed
        assert saved[0][stream] != saved[1][stream], stream
    for rank, r in enumerate(results):
        assert r["after_save"] == saved[rank], f"rank {rank}'s RNG file is not the state it held"
        assert r["seeded"] != saved[rank], "the restarted Trainer's seeding alone gives the saved state"
        assert r["restored"] == saved[rank], f"rank {rank} did not get back the RNG state it saved"

    assert cli_main(["ckpt", "verify", "--rng", str(run_dir)]) == 0
    assert capsys.readouterr().out.count(": ok") == len(CheckpointManager(run_dir / "checkpoints").list()) == 1


def test_ckpt_verify_rng_names_a_copied_or_missing_rank(tmp_path, capsys):
    """`ckpt verify --rng` passes a 2-rank checkpoint with per-rank streams, and names the file when rank 1
    holds rank 0's state or when rank 1's file is missing (identity still says world size 2)."""
    state = example_state(seed=3, ranks=2)
    variants = {"good": state["rng"], "copied": [state["rng"][0], state["rng"][0]], "short": state["rng"][:1]}
    for name, rng in variants.items():
        CheckpointManager(tmp_path / name).save(2, dict(state, rng=rng))
    assert cli_main(["ckpt", "verify", "--rng", str(tmp_path / "good")]) == 0
    assert cli_main(["ckpt", "verify", "--rng", str(tmp_path / "copied")]) == 1
    out = capsys.readouterr().out
    assert "step-000002/rng/rank-00001.pt: 'python' state identical to rank 0's" in out
    assert "step-000002/rng/rank-00001.pt: 'numpy_global' state identical to rank 0's" in out
    assert cli_main(["ckpt", "verify", "--rng", str(tmp_path / "short")]) == 1
    assert "step-000002: 1 RNG file(s) for a run of world size 2" in capsys.readouterr().out
    assert cli_main(["ckpt", "verify", str(tmp_path / "short")]) == 0  # intact files: only --rng sees it


@pytest.fixture(scope="module")
def augmented_reference(tmp_path_factory, smoke_dataset) -> dict:
    """The uninterrupted run, on ranks forked from the test (the killed runs are real `worldpipe train`)."""
    root = tmp_path_factory.mktemp("augmented_reference")
    train_on_ranks(train_cmd(root / "run", smoke_dataset, 30, 10)[2:], tmp=root / "ranks")
    return {"dir": root / "run", "digest": checkpoint_digest(root / "run" / "checkpoints")}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 4])
def test_kill9_at_random_point_resumes_bit_exact(seed, tmp_path, smoke_dataset, env_with_venv,
                                                  augmented_reference):
    run_dir = tmp_path / "run"
    cmd = train_cmd(run_dir, smoke_dataset, 30, 10)
    kill = kill_at_random_point(cmd, run_dir, env_with_venv, seed, final_step=30)
    print(f"kill landed after step {kill.step} (delay {kill.delay_s:.2f} s, attempt {kill.attempts})")
    resumed = run(cmd, env_with_venv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_digest(run_dir / "checkpoints") == augmented_reference["digest"]
    # The digest leaves RNG out by definition: the final RNG files must match too, rank by rank.
    assert saved_fingerprints(run_dir, 30) == saved_fingerprints(augmented_reference["dir"], 30)
    final = CheckpointManager(run_dir / "checkpoints").load(30)["model"]
    expected = CheckpointManager(augmented_reference["dir"] / "checkpoints").load(30)["model"]
    assert all(torch.equal(final[k], expected[k]) for k in expected)

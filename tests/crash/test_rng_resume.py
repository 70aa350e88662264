"""Per-rank RNG restore in real training: `experiment=smoke_augmented` draws input augmentation from every
rank's global Python, NumPy and torch generators, so a resume is bit-identical only if each rank gets back
exactly the state it saved (restoring rank 0's state everywhere must fail these tests).

Real torchrun (2 gloo ranks), real checkpoint files, real SIGKILL. The model's RNG trace
(``WORLDPIPE_RNG_TRACE``) records, per rank and per training step, a fingerprint of the generator states the
step draws from; the tests compare those with the states each rank saved in the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from kill_support import assert_died_of_sigkill, kill_at_random_point

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.rng_audit import rng_fingerprint
from worldpipe.cli import main as cli_main
from worldpipe.trainer.seeding import PER_RANK_STREAMS, RNG_TRACE_ENV, RNG_TRACE_FORMAT

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


def read_trace(trace_dir: Path, rank: int) -> list[list[dict]]:
    """The rank's trace split by process: one list of per-step fingerprints per training process, in order."""
    processes: dict[int, list[dict]] = {}
    for line in (trace_dir / RNG_TRACE_FORMAT.format(rank=rank)).read_text().splitlines():
        entry = json.loads(line)
        processes.setdefault(entry["pid"], []).append({k: entry["rng"][k] for k in TRACED_STREAMS})
    return list(processes.values())


def saved_fingerprints(run_dir: Path, step: int) -> list[dict]:
    rng = CheckpointManager(run_dir / "checkpoints").load(step, keys=["rng"])["rng"]
    return [{k: rng_fingerprint(r)[k] for k in TRACED_STREAMS} for r in rng]


def assert_killed_mid_files(root: Path, step: int, previous: int) -> None:
    """The kill landed at ``mid_files`` of ``step``: its hidden partial directory holds a file, and the newest
    intact step (the one `latest` names) is the previous one."""
    partial = [p for p in root.iterdir() if p.name.startswith(f".step-{step:06d}.partial-")]
    assert len(partial) == 1 and any(p.is_file() for p in partial[0].rglob("*")), sorted(p.name for p in root.iterdir())
    assert CheckpointManager(root).latest_intact() == previous
    assert (root / "latest").read_text().strip() == f"step-{previous:06d}"


@pytest.mark.slow  # 15 s of torchrun: the default tier's budget is 5 minutes
def test_each_rank_resumes_with_the_rng_state_it_saved(tmp_path, smoke_dataset, env_with_venv, capsys):
    """Killed inside the save of step 4 (step 2 is the newest intact), resumed: at step 3 every rank draws
    from the state it saved at step 2 and from the very state the killed process drew from."""
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    cmd = train_cmd(run_dir, smoke_dataset, 4, 2)
    killed = run(cmd, env_with_venv, WORLDPIPE_CKPT_FAULT="mid_files@4:die", **{RNG_TRACE_ENV: str(trace)})
    assert_died_of_sigkill(killed, run_dir, rank=0)  # killed, not an exit: rank 0 writes the (unsharded) files
    assert not (run_dir / "train_done.json").exists()
    assert_killed_mid_files(run_dir / "checkpoints", step=4, previous=2)
    resumed = run(cmd, env_with_venv, **{RNG_TRACE_ENV: str(trace)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    saved = saved_fingerprints(run_dir, 2)
    assert len(saved) == RANKS
    for stream in PER_RANK_STREAMS:  # otherwise restoring rank 0's state everywhere would go unnoticed
        assert saved[0][stream] != saved[1][stream], stream
    for rank in range(RANKS):
        first, second = read_trace(trace, rank)
        assert len(first) == 4 and len(second) == 2  # steps 1-4, then steps 3-4 after the resume
        assert second[0] == saved[rank], f"rank {rank} did not get back the RNG state it saved"
        assert second == first[2:], f"rank {rank} drew from other states than the interrupted run"

    assert cli_main(["ckpt", "verify", "--rng", str(run_dir)]) == 0
    assert capsys.readouterr().out.count(": ok") == len(CheckpointManager(run_dir / "checkpoints").list()) == 2


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
def augmented_reference(tmp_path_factory, smoke_dataset, env_with_venv) -> dict:
    run_dir = tmp_path_factory.mktemp("augmented_reference") / "run"
    proc = run(train_cmd(run_dir, smoke_dataset, 30, 10), env_with_venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dir": run_dir, "digest": checkpoint_digest(run_dir / "checkpoints")}


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

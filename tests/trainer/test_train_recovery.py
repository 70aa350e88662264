"""Training-level recovery: kill -9 anywhere, faults inside publication, preemption signals, corrupt
checkpoints, world-size changes and identity checks. Real torchrun (2 gloo ranks), real files, real signals.

Every interrupted run is resumed with the same command and must end with the digest of the uninterrupted
run (same world size), or allclose parameters (different world size).

The uninterrupted references and the runs killed by a fault at a phase of step 20's save are the session's
shared smoke runs (tests/smoke_runs.py, also read by test_fsdp2.py, test_sharded_training.py and
test_loadable_resume.py): a test resumes or damages a copy, so e.g. the run killed right after step 20 was
published is trained once for the publication, refusal and world-size tests together. The references train
on ranks forked from the test; every interrupted run here is a real `worldpipe train` (torchrun), so each
digest comparison also checks that both ways of starting the ranks train the same bits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from datasets import SMOKE_SPEC, build_dataset
from kill_support import assert_died_of_sigkill, kill_at_random_point
from processes import pids_with_arg, wait_gone
from smoke_runs import STEPS, SmokeRuns, run_train, train_cmd
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest

pytestmark = [pytest.mark.crash, pytest.mark.slow]

# World-size changes only reorder floating-point reductions (docs/architecture.md, "The state contract": the global batch is world-size
# invariant): the parameters must agree to this tolerance after 30 steps.
WORLD_SIZE_RTOL, WORLD_SIZE_ATOL = 1e-4, 1e-6


def published_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir()) if (run_dir / "checkpoints").exists() else []


def assert_no_partial_reported(run_dir: Path) -> None:
    """Every step the manager lists is a real step directory; a partial one is never listed."""
    for info in CheckpointManager(run_dir / "checkpoints").list():
        assert not Path(info.path).name.startswith("."), info


def resume_and_digest(run_dir, dataset, env, *extra) -> str:
    proc = run_train(run_dir, dataset, env, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((run_dir / "train_done.json").read_text())["final_step"] == STEPS
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".partial" in p.name], "leftover partial dir"
    return checkpoint_digest(run_dir / "checkpoints")


@pytest.fixture(scope="module")
def reference(smoke_runs) -> dict:
    """Uninterrupted runs on 2 ranks and on 1 rank (shared: read only)."""
    out = {}
    for world in (2, 1):
        run_dir = smoke_runs.straight(f"parallel.nproc_per_node={world}").dir
        out[world] = {"dir": run_dir, "digest": checkpoint_digest(run_dir / "checkpoints")}
    return out


def killed_at(smoke_runs: SmokeRuns, fault: str, dest: Path, ranks: int = 2) -> Path:
    """A copy at ``dest`` of the shared run of ``ranks`` ranks killed by ``fault``, asserted to have died of
    SIGKILL (rank 0 writes the unsharded checkpoint; with one rank the launcher itself dies)."""
    run = smoke_runs.killed(fault, f"parallel.nproc_per_node={ranks}")
    assert_died_of_sigkill(run.proc, run.dir, rank=0)
    return smoke_runs.copy(run, dest)


def kill_tree(proc: subprocess.Popen, run_dir: Path, mode: str) -> None:
    """SIGKILL a training run: every process of it ("tree"), or only the launcher's process group.

    torchrun starts each worker in a session of its own, so "launcher_group" reaches the launcher and torchrun
    only; the workers must die with them (no orphan keeps training or publishing).
    """
    # The launcher and torchrun carry run_dir=...; the workers carry --config=RUN_DIR/hydra/config.yaml.
    def ours() -> set[int]:
        return pids_with_arg(f"run_dir={run_dir}") | pids_with_arg(f"{run_dir}/hydra/")

    processes = ours()
    os.killpg(proc.pid, signal.SIGKILL)
    if mode == "tree":
        for pid in processes - {proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc.wait(timeout=30) != -signal.SIGKILL:
        return  # the run ended between the caller's poll and the kill: the caller sees its status and retries
    # The workers die a moment after torchrun (their lifeline): the state is the one they leave when gone.
    survivors = wait_gone(processes | ours(), timeout=30)
    assert not survivors, f"orphans after killing the launcher ({mode}): {survivors}"
    at_kill = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    time.sleep(0.5)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == at_kill, "written after every process died"


# Each way of killing at its own random point (tests/trainer/test_rng_resume.py kills at more points).
@pytest.mark.parametrize(("seed", "mode"), [(1, "tree"), (2, "launcher_group")])
def test_kill9_at_random_points_resumes_bit_exact(seed, mode, tmp_path, smoke_dataset, env_with_venv, reference):
    run_dir = tmp_path / "run"
    kill = kill_at_random_point(train_cmd(run_dir, smoke_dataset), run_dir, env_with_venv, seed, final_step=STEPS,
                                kill=lambda proc, where: kill_tree(proc, where, mode))
    print(f"kill ({mode}) landed after step {kill.step} (delay {kill.delay_s:.2f} s, attempt {kill.attempts})")
    assert_no_partial_reported(run_dir)
    assert resume_and_digest(run_dir, smoke_dataset, env_with_venv) == reference[2]["digest"]


# phase -> (step 20 published, step `latest` names) when a kill at that phase of step 20's save lands
KILLED_AT = {"mid_files": (False, 10), "after_files": (False, 10), "after_manifest": (False, 10),
             "after_rename": (True, 10), "after_latest": (True, 20), "before_retention": (True, 20)}
# One phase of each state a kill can leave for the resume (a hidden partial step 20 with some of its files;
# step 20 published but `latest` naming step 10; `latest` naming step 20) is resumed here; the others are checked
# as the store shows them. checkpoint/test_publish_crash.py kills a publication at every phase and checks that the
# newest intact step loads and the next save publishes over what the kill left.
RESUMED_AT = {"mid_files", "after_rename", "after_latest"}


@pytest.mark.parametrize("phase", sorted(KILLED_AT))
def test_kill9_inside_publication_resumes_bit_exact(phase, tmp_path, smoke_runs, smoke_dataset, env_with_venv,
                                                    reference):
    run_dir = killed_at(smoke_runs, f"{phase}@20:die", tmp_path / "run")
    assert "step-000010" in published_steps(run_dir), "the previous checkpoint must survive"
    assert_no_partial_reported(run_dir)
    # Where the kill landed, as the store shows it: before the rename only a hidden partial step 20 exists,
    # after it step 20 is published, and `latest` names it from after_latest on.
    published, named = KILLED_AT[phase]
    assert ("step-000020" in published_steps(run_dir)) == published, published_steps(run_dir)
    assert any(".step-000020.partial-" in n for n in published_steps(run_dir)) == (not published)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{named:06d}"
    assert CheckpointManager(run_dir / "checkpoints").latest_intact() == (20 if published else 10)
    if phase in RESUMED_AT:
        assert resume_and_digest(run_dir, smoke_dataset, env_with_venv) == reference[2]["digest"]


# SIGUSR1 on one process is trainer/test_preemption_quick.py's (default tier), on two ranks slurm/test_preemption.py's.
def test_preemption_signal_checkpoints_and_exits_75(tmp_path, smoke_dataset, env_with_venv, reference):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(run_dir, smoke_dataset), env=env_with_venv, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    record = json.loads((run_dir / "PREEMPTED").read_text())
    assert f"step-{record['final_step']:06d}" in published_steps(run_dir)
    assert resume_and_digest(run_dir, smoke_dataset, env_with_venv) == reference[2]["digest"]
    assert not (run_dir / "PREEMPTED").exists()


def test_flipped_byte_falls_back_to_previous_step(tmp_path, smoke_runs, smoke_dataset, env_with_venv, reference):
    run_dir = smoke_runs.copy(smoke_runs.straight("parallel.nproc_per_node=2"), tmp_path / "run")
    step_dir = run_dir / "checkpoints" / "step-000030"
    victim = max((p for p in step_dir.rglob("*") if p.is_file() and p.name != "MANIFEST.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    (run_dir / "train_done.json").unlink()

    verify = subprocess.run(["worldpipe", "ckpt", "verify", str(run_dir)], env=env_with_venv,
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode != 0
    assert victim.name in verify.stdout + verify.stderr

    resumed = run_train(run_dir, smoke_dataset, env_with_venv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert "step-000030" in output and "resumed from" in output
    assert "step 20" in output.split("resumed from", 1)[1].splitlines()[0]
    assert checkpoint_digest(run_dir / "checkpoints") == reference[2]["digest"]


def _final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return CheckpointManager(run_dir / "checkpoints").load()["model"]


@pytest.mark.parametrize(("first", "second"), [(2, 1), (1, 2)])
def test_world_size_change_keeps_sample_order(first, second, tmp_path, smoke_runs, smoke_dataset, env_with_venv,
                                              reference):
    run_dir = killed_at(smoke_runs, "after_latest@20:die", tmp_path / "run", ranks=first)
    assert CheckpointManager(run_dir / "checkpoints").latest_intact() == 20
    resumed = run_train(run_dir, smoke_dataset, env_with_venv, f"parallel.nproc_per_node={second}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"written by {first} ranks, now {second}" in resumed.stdout + resumed.stderr

    expected = CheckpointManager(reference[first]["dir"] / "checkpoints").load()
    got = CheckpointManager(run_dir / "checkpoints").load()
    assert got["sampler"] == expected["sampler"]  # same global sample order and position
    assert got["progress"] == expected["progress"]
    worst = 0.0
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=WORLD_SIZE_RTOL, atol=WORLD_SIZE_ATOL)
        denom = tensor.abs().clamp_min(1e-8)
        worst = max(worst, float(((got["model"][name] - tensor).abs() / denom).max()))
    print(f"world size {first}->{second}: max relative parameter difference {worst:.3e}")


def killed_after_step_20(smoke_runs: SmokeRuns, dest: Path) -> Path:
    """A copy of the run SIGKILLed right after step 20 was published (`latest` names it): what the refusals
    resume from."""
    run_dir = killed_at(smoke_runs, "after_latest@20:die", dest)
    assert CheckpointManager(run_dir / "checkpoints").latest_intact() == 20
    return run_dir


def test_changed_config_is_refused_with_a_diff(tmp_path, smoke_runs, smoke_dataset, env_with_venv):
    run_dir = killed_after_step_20(smoke_runs, tmp_path / "run")
    refused = run_train(run_dir, smoke_dataset, env_with_venv, "trainer.lr=0.01")
    assert refused.returncode == 2
    assert "trainer.lr: 0.001 -> 0.01" in refused.stderr
    assert "allow_config_change" in refused.stderr
    # Safe keys (logging, checkpoint interval) may change; the run resumes and finishes.
    ok = run_train(run_dir, smoke_dataset, env_with_venv, "trainer.log_every=3", "checkpoint.every=5")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "resumed from" in ok.stdout + ok.stderr


def test_changed_dataset_is_refused(tmp_path, smoke_runs, env_with_venv):
    run_dir = killed_after_step_20(smoke_runs, tmp_path / "run")
    other = build_dataset(tmp_path / "other", env_with_venv, {**SMOKE_SPEC, "seed": 7})
    refused = run_train(run_dir, other, env_with_venv)
    assert refused.returncode == 2
    assert "dataset" in refused.stderr and "step 20" in refused.stderr


def test_async_saves_give_the_same_state(tmp_path, smoke_dataset, env_with_venv, reference):
    run_dir = tmp_path / "async"
    proc = run_train(run_dir, smoke_dataset, env_with_venv, "checkpoint.async_save=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_digest(run_dir / "checkpoints") == reference[2]["digest"]
    assert json.loads((run_dir / "train_done.json").read_text())["digest"] == reference[2]["digest"]
    # An uninterrupted `worldpipe train` (torchrun) from scratch ends with the forked reference's exact tensors.
    a = np.concatenate([t.flatten().numpy() for t in _final_model(run_dir).values()])
    b = np.concatenate([t.flatten().numpy() for t in _final_model(reference[2]["dir"]).values()])
    assert a.tobytes() == b.tobytes()

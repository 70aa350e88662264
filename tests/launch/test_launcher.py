"""Cases 1, 2, 5 and 7 of issue 9 with real torchrun process groups: workers die with their launcher, one
run per run directory, rendezvous stores on loopback only, and a worker's error as one line."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from processes import listening_addresses, pids_with_arg, snapshot_dir, wait_gone
from worldpipe.checkpoint.layout import is_leftover

pytestmark = [pytest.mark.adversarial, pytest.mark.integration, pytest.mark.crash, pytest.mark.slow]


def train_cmd(run_dir: Path, dataset, *extra: str) -> list[str]:
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false",
            "trainer.steps=2000", "checkpoint.every=5", *extra]


def start(run_dir: Path, dataset, env) -> subprocess.Popen:
    # A session of its own, as `setsid worldpipe train ...` or a job runner would start it.
    return subprocess.Popen(train_cmd(run_dir, dataset), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def workers_of(run_dir: Path) -> set[int]:
    return pids_with_arg("worldpipe.launch.worker") & pids_with_arg(str(run_dir))


def kill_launcher_group(proc: subprocess.Popen, run_dir: Path) -> set[int]:
    """SIGKILL the launcher's process group only; returns every process of the run seen around the kill."""
    tree = pids_with_arg(str(run_dir))
    assert proc.pid in tree
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the kill landed on the launcher itself
    return tree | pids_with_arg(str(run_dir))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killing_the_launcher_group_leaves_no_worker_and_publishes_nothing(seed, tmp_path, smoke_dataset,
                                                                          env_with_venv):
    run_dir = tmp_path / "run"
    proc = start(run_dir, smoke_dataset, env_with_venv)
    # Anywhere from start-up (rendezvous, imports) to the middle of training and saving.
    time.sleep(random.Random(seed).uniform(0.5, 30.0))
    tree = kill_launcher_group(proc, run_dir)
    at_kill = published_view(run_dir / "checkpoints")
    survivors = wait_gone(tree, timeout=30)
    assert not survivors, f"still running after the launcher's group was killed: {survivors}"
    assert not pids_with_arg(str(run_dir))
    assert published_view(run_dir / "checkpoints") == at_kill, "a checkpoint was published after the kill"


def published_view(checkpoints: Path) -> tuple[dict[str, int], bytes | None]:
    """What a reader of the checkpoint directory sees: the published names (with their inodes) and ``latest``.

    The workers die by their lifeline a few milliseconds after the launcher, so one of them may still create a
    hidden ``.step-N.partial-*`` in that window; that is unpublished by construction and the next writer removes
    it, so it is left out here. A rename into ``step-N`` or a new ``latest`` in that window is not.
    """
    latest = checkpoints / "latest"
    names = {name: inode for name, inode in snapshot_dir(checkpoints).items() if not is_leftover(name)}
    return names, latest.read_bytes() if latest.exists() else None


def test_one_run_per_directory_and_rendezvous_on_loopback(tmp_path, smoke_dataset, env_with_venv):
    run_dir = tmp_path / "run"
    first = start(run_dir, smoke_dataset, env_with_venv)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").exists())
        tree = pids_with_arg(str(run_dir))
        listening = listening_addresses(tree)
        assert listening, "the rendezvous store should be listening"
        assert all(address.startswith("127.0.0.1:") for address in listening), listening

        second = subprocess.run(train_cmd(run_dir, smoke_dataset), env=env_with_venv, capture_output=True,
                                text=True, timeout=120)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode != 0 and len(lines) == 1, second.stderr
        assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0]
        assert pids_with_arg(str(run_dir)) <= tree | {first.pid}  # the second run started nothing
        assert first.poll() is None
    finally:
        if first.poll() is None:
            tree = kill_launcher_group(first, run_dir)
            assert not wait_gone(tree, timeout=30)

    # The holder is dead (kill -9): its lock is taken over at once, however stale the file's content.
    from worldpipe.launch.run_lock import RunLock

    assert f'"pid": {first.pid}' in (run_dir / ".run.lock").read_text()
    with RunLock(run_dir):
        assert f'"pid": {os.getpid()}' in (run_dir / ".run.lock").read_text()


def test_a_workers_error_is_one_line(tmp_path, smoke_dataset, env_with_venv):
    store, manifest = smoke_dataset
    copy = tmp_path / "data"
    subprocess.run(["cp", "-r", str(store.parent), str(copy)], check=True)
    shard = sorted(p for p in (copy / "store.zarr" / "obs").rglob("*") if p.is_file() and p.name != "zarr.json")[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run(train_cmd(run_dir, (copy / "store.zarr", copy / "manifest.json"), "trainer.steps=30"),
                          env=env_with_venv, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: corrupt dataset file"), proc.stderr[-3000:]
    assert str(shard.relative_to(copy / "store.zarr")) in errors[0]
    for noise in ("Traceback", "ChildFailedError", "Connection closed by peer", "error (secondary)"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    log = (run_dir / "errors.log").read_text()
    assert "Traceback (most recent call last)" in log and "CorruptShardError" in log
    assert not pids_with_arg(str(run_dir))
    assert not (run_dir / "checkpoints" / "latest").exists()  # stopped before its first checkpoint


class Payload:
    """Pickled as an object `torch.load(weights_only=True)` rightly refuses to build."""


def test_resume_skips_a_hash_valid_but_unloadable_step(tmp_path, smoke_dataset, env_with_venv):
    import hashlib
    import json

    import torch

    run_dir = tmp_path / "run"
    first = subprocess.run(train_cmd(run_dir, smoke_dataset, "trainer.steps=20", "checkpoint.every=10"),
                           env=env_with_venv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    step_dir = run_dir / "checkpoints" / "step-000020"
    torch.save({"weights": Payload()}, step_dir / "model.pt")
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    manifest.pop("manifest_sha256")
    data = (step_dir / "model.pt").read_bytes()
    for entry in manifest["files"]:
        if entry["path"] == "model.pt":
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest, sort_keys=True, indent=2))
    verify = subprocess.run(["worldpipe", "ckpt", "verify", str(run_dir)], env=env_with_venv,
                            capture_output=True, text=True, timeout=120)
    # Every hash matches, and verify still names the step: verify means loadable (a weights-only load is tried).
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "step 10: ok" in verify.stdout and "step-000020/model.pt: cannot load" in verify.stdout

    resumed = subprocess.run(train_cmd(run_dir, smoke_dataset, "trainer.steps=30", "checkpoint.every=10"),
                             env=env_with_venv, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert "skipping checkpoint" in output and "step-000020" in output
    assert "step 10" in output.split("resumed from", 1)[1].splitlines()[0]
    assert json.loads((run_dir / "train_done.json").read_text())["final_step"] == 30

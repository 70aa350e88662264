"""The device check: training on a CUDA GPU, bitwise, end to end (`make gpu-check`; run by hand where CUDA exists).

No CI machine has a GPU, so this is not a pytest tier: it runs where one is, and exits non-zero with one line
where none is (never a silent pass). On the first CUDA device it
  1. records the numerics environment a CUDA run records (device, CUDA, cuDNN, NCCL, deterministic settings);
  2. trains the smoke experiment (RSSM: the compiled filter core must step aside for the reference on CUDA);
  3. trains it again, kills the launcher with SIGKILL after its first checkpoint, resumes, and compares the final
     checkpoint digest with the uninterrupted run's (bitwise on the same GPU);
  4. reruns the first run from its MLflow records alone (`worldpipe rerun`: exit 0, bit-identical);
  5. trains the pixel model (convolutions: cuDNN) twice and compares digests.
Every result is printed as one line and written to ``$OUT/gpu_check.json`` (or ``--out``).

    python tests/gpu/gpu_check.py [--work DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE_STEPS, PIXEL_STEPS = 40, 20


def fail(message: str) -> None:
    print(f"gpu-check: FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def worldpipe(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the worldpipe CLI of this checkout (its output passes through)."""
    proc = subprocess.run([sys.executable, "-m", "worldpipe.cli", *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print(proc.stdout, end="", flush=True)
    if check and proc.returncode != 0:
        fail(f"`worldpipe {' '.join(args)}` exited {proc.returncode}")
    return proc


def build(work: Path, name: str, pixels: bool) -> tuple[str, str]:
    from worldpipe.data.build import build_dataset
    from worldpipe.data.spec import DatasetSpec

    spec = DatasetSpec(name=name, env_id="Pendulum-v1", policy="noisy_controller", episodes=12, max_steps=48,
                       episodes_per_shard=4, seed=0, pixels=pixels, pixel_size=32)
    store, manifest = work / name / "store.zarr", work / name / "manifest.json"
    build_dataset(str(store), spec, manifest_path=str(manifest))
    return str(store), str(manifest)


def train_args(run_dir: Path, data: tuple[str, str], uri: str, *extra: str) -> list[str]:
    return ["train", *extra, f"run_dir={run_dir}", f"data.store={data[0]}", f"data.manifest={data[1]}",
            f"tracking.uri={uri}", "parallel.nproc_per_node=1", "trainer.progress_bar=false"]


def digest(run_dir: Path) -> str:
    out = worldpipe("ckpt", "digest", str(run_dir)).stdout.strip().splitlines()
    return out[-1].split()[-1]


def kill_after_first_checkpoint(args: list[str], run_dir: Path) -> int:
    """Start training, SIGKILL its launcher's whole process group once a checkpoint is published."""
    latest = run_dir / "checkpoints" / "latest"
    proc = subprocess.Popen([sys.executable, "-m", "worldpipe.cli", *args], start_new_session=True)
    deadline = time.monotonic() + 300
    while not latest.exists():
        if proc.poll() is not None:
            fail(f"training ended (exit {proc.returncode}) before its first checkpoint")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            fail("no checkpoint within 300 s")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return int(latest.read_text().strip().rsplit("-", 1)[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run the same steps on the CPU (checks this script where no GPU is; proves nothing of CUDA)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.rehearse_on_cpu:
        fail("no CUDA device here (torch.cuda.is_available() is False); run this where a GPU is")
    from worldpipe.core import numerics

    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    uri = f"sqlite:///{work}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "WORLDPIPE_LAUNCHER": "torchrun"}
    os.environ.update(env)
    report: dict = {"torch": torch.__version__, "environment": numerics.expected_environment(
        {"trainer": {"threads_per_rank": 1, "deterministic": True}})}
    print("numerics environment: " + json.dumps(report["environment"]), flush=True)

    from worldpipe.models.rssm_filter import _FilterCore, chosen_core

    core = chosen_core(torch.zeros(1, device="meta" if args.rehearse_on_cpu else "cuda"))
    report["filter_core_on_cuda"] = core.__name__
    if core is not _FilterCore:
        fail(f"the compiled filter core was chosen for CUDA tensors ({core.__name__})")

    state, frames = build(work, "pendulum", False), build(work, "pendulum_pixels", True)
    base = train_args(work / "smoke-a", state, uri, "experiment=smoke", f"trainer.steps={SMOKE_STEPS}")
    started = time.monotonic()
    worldpipe(*base, env=env)
    report["smoke_train_s"] = round(time.monotonic() - started, 1)
    report["smoke_digest"] = digest(work / "smoke-a")

    resumed_args = train_args(work / "smoke-b", state, uri, "experiment=smoke", f"trainer.steps={SMOKE_STEPS}")
    report["killed_at_step"] = kill_after_first_checkpoint(resumed_args, work / "smoke-b")
    worldpipe(*resumed_args, env=env)
    report["resumed_digest"] = digest(work / "smoke-b")
    report["resume_bitwise"] = report["resumed_digest"] == report["smoke_digest"]

    run_id = json.loads((work / "smoke-a" / "train_done.json").read_text())["mlflow_run_id"]
    rerun = worldpipe("rerun", run_id, "--tracking-uri", uri, "--run-dir", str(work / "smoke-rerun"), env=env,
                      check=False)
    report["rerun_exit"] = rerun.returncode
    report["rerun_verdict"] = rerun.stdout.strip().splitlines()[-1] if rerun.stdout.strip() else ""

    pixel_digests = []
    for name in ("pixels-a", "pixels-b"):
        worldpipe(*train_args(work / name, frames, uri, "experiment=pendulum_pixels", f"trainer.steps={PIXEL_STEPS}",
                              "checkpoint.every=10", "trainer.log_every=5", "data.window=8", "model.image_size=32"),
                  env=env)
        pixel_digests.append(digest(work / name))
    report["pixel_digests"] = pixel_digests
    report["pixel_bitwise"] = pixel_digests[0] == pixel_digests[1]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for key in ("filter_core_on_cuda", "smoke_digest", "killed_at_step", "resumed_digest", "resume_bitwise",
                "rerun_exit", "rerun_verdict", "pixel_digests", "pixel_bitwise"):
        print(f"gpu-check: {key}: {report[key]}", flush=True)
    problems = [name for name, ok in (("resume", report["resume_bitwise"]), ("rerun", report["rerun_exit"] == 0),
                                      ("pixels", report["pixel_bitwise"])) if not ok]
    if problems:
        fail("not bitwise: " + ", ".join(problems))
    print("gpu-check: passed", flush=True)


if __name__ == "__main__":
    main()

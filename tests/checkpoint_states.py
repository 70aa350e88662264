"""Helpers for tests of code that checkpoints: realistic example states and deliberate damage."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from worldpipe.checkpoint.state import capture_rng


def example_state(seed: int = 0, ranks: int = 1, width: int = 16, scheduler: bool = True,
                  ema: bool = False, scaler: bool = False) -> dict:
    """A small but complete training state: a model after one Adam step, scheduler, progress, sampler, RNG."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10) if scheduler else None
    rng = []
    for rank in range(ranks):
        random.seed(seed * 1000 + rank)
        np.random.seed(seed * 1000 + rank)
        torch.manual_seed(seed * 1000 + rank)
        rng.append(capture_rng({"latent": torch.Generator().manual_seed(seed * 7 + rank)}))
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict() if sched is not None else None,
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                   "_growth_tracker": 3} if scaler else None,
        "ema": {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()} if ema else None,
        "progress": {"step": 10, "epoch": 1, "samples_seen": 640, "tokens_seen": 81920},
        "sampler": {"seed": seed, "epoch": 1, "cursor": 640},
        "rng": rng,
        "identity": {"config_hash": "c0ffee", "dataset_hash": "d00d", "code_version": "abc123+dirty",
                     "world_size": ranks, "parallel_layout": {"dp": ranks}, "mlflow_run_id": "run-1"},
    }


def flip_byte(path: str | os.PathLike, offset: int | None = None) -> int:
    """Invert one byte of a file in place (default: the middle byte); return the offset flipped."""
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is empty")
    offset = size // 2 if offset is None else offset % size
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return offset


def rehash_step(step_dir: str | os.PathLike) -> None:
    """Make a step's MANIFEST.json agree with its files' current bytes again, as a forger would: every listed
    file's size and sha256, then the manifest's own checksum. Everything else in the manifest stays."""
    import hashlib
    import json
    from pathlib import Path

    step_dir = Path(step_dir)
    path = step_dir / "MANIFEST.json"
    body = json.loads(path.read_text())
    body.pop("manifest_sha256")
    for entry in body["files"]:
        data = (step_dir / entry["path"]).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(body, sort_keys=True, indent=2))


def slice_model_file(step_dir: str | os.PathLike) -> None:
    """Re-save a step's model.pt with every tensor cut to its first half along dim 0 (issue 19, case 1)."""
    from pathlib import Path

    path = Path(step_dir) / "model.pt"
    model = torch.load(path, weights_only=True)
    torch.save({k: v[: max(1, v.shape[0] // 2)].clone() if v.dim() else v for k, v in model.items()}, path)


def save_until_killed(root, fault: str, mode: str, options: dict | None, out) -> None:
    """The crash tests' dying saver: save step 1, then arm ``fault`` (WORLDPIPE_CKPT_FAULT) and save steps 2, 3, ...
    until the fault or the test kills this process; prints ``saved N`` to ``out`` after each save."""
    from worldpipe.checkpoint import CheckpointManager

    cm = CheckpointManager(root, keep_last=2, async_save=(mode == "async"), storage_options=options)
    cm.save(1, example_state(seed=1))
    cm.wait()
    print("saved 1", file=out, flush=True)
    if fault:
        os.environ["WORLDPIPE_CKPT_FAULT"] = fault
    step = 2
    while True:  # without a fault: save until killed from outside
        cm.save(step, example_state(seed=step))
        cm.wait()
        print(f"saved {step}", file=out, flush=True)
        step += 1

"""Worker of the sharded-checkpoint tests: trains a small MLP in a layout, saves, resumes, measures.

    torchrun --nproc-per-node N sharded_worker.py MODE ROOT OUT [--layout fsdp2|ddp|single] [--resume-step S]
        [--steps K] [--save-at S1,S2] [--width W] [--full] [--async-save]

or :func:`run` with the same arguments on ranks forked from the test (sharded_support.on_forked_ranks).

MODE ``train``: resume from checkpoint ``--resume-step`` in ROOT (if given) into the current layout, train to
``--steps``, saving sharded (``--full``: gathered to rank 0, the unsharded path; ``--async-save``: in the
background, the copy overlapping the next step) at ``--save-at``; rank 0
writes OUT (JSON: final parameters as lists, sampler, steps run). ``memory``: rank 0's peak RSS above its
baseline during a sharded save and during a gathered (full) save of the same state, and the state's size.
Data is a function of (global sample index), the global batch is split across ranks, and the loss is the
global mean, so every world size follows the same trajectory up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from worldpipe.checkpoint import CheckpointManager, capture_rng
from worldpipe.checkpoint.resharding import load_resharded
from worldpipe.checkpoint.sharded_saver import ShardedSaver
from worldpipe.measure.write_baseline import tensors_in

GLOBAL_BATCH = 8


def build(width: int, layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, width + 3), nn.Tanh(),
                          nn.Linear(width + 3, 3))
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for child in model:
            if isinstance(child, nn.Linear):
                fully_shard(child)
        fully_shard(model)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def state_of(model, optimizer, step: int, full: bool) -> dict:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return {"model": get_model_state_dict(module, options=options),
            "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
            "progress": {"step": step, "epoch": 0, "samples_seen": step * GLOBAL_BATCH, "tokens_seen": 0},
            "sampler": {"cursor": step * GLOBAL_BATCH}, "rng": [capture_rng()], "identity": {"layout": "test"}}


def save(saver: ShardedSaver, model, optimizer, step: int, full: bool) -> None:
    state = state_of(model, optimizer, step, full)
    if not full:
        saver.save(step, state, optimizer)
    elif dist.get_rank() == 0:
        saver.manager.save(step, state)
    if not saver.async_save:
        dist.barrier()


def train(args, rank: int, world: int) -> dict:
    model, optimizer = build(args.width, args.layout)
    cm = CheckpointManager(args.root, keep_last=3)
    saver = ShardedSaver(cm, async_save=args.async_save)
    step, sampler = 0, None
    if args.resume_step is not None:
        rest = load_resharded(cm, args.resume_step, model, optimizer)
        step, sampler = rest["progress"]["step"], rest["sampler"]
    save_at = {int(s) for s in args.save_at.split(",") if s}
    while step < args.steps:
        x, y = batch(step, rank, world)
        loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH * world  # ranks average gradients: global mean
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step in save_at:
            save(saver, model, optimizer, step, args.full)
    saver.manager.close()
    full = state_of(model, optimizer, step, True)
    return {"step": step, "resumed_sampler": sampler,
            "model": {k: v.tolist() for k, v in full["model"].items()}}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_during(fn) -> int:
    """Bytes of rank 0's peak RSS above its RSS before ``fn`` (the kernel's high-water mark, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


def memory(args, rank: int, world: int) -> dict:
    model, optimizer = build(args.width, "fsdp2")
    x, y = batch(0, rank, world)
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()
    saver = ShardedSaver(CheckpointManager(args.root, keep_last=2))
    sharded_state = state_of(model, optimizer, 1, False)
    local = sum(t.to_local().numel() * t.element_size() for t in tensors_in(sharded_state) if hasattr(t, "to_local"))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + Adam's two
    peaks = {"sharded": _peak_during(lambda: save(saver, model, optimizer, 1, False))}
    peaks["full"] = _peak_during(lambda: save(saver, model, optimizer, 2, True))
    return {"peak_bytes": peaks, "full_state_bytes": full_bytes, "rank0_shard_bytes": local,
            "threads": threading.active_count()}


def run(argv: list[str]) -> None:
    """MODE on this rank of the process group joined already (torchrun's, or a forked rank's); rank 0 writes
    OUT."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "memory"])
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--layout", default="fsdp2", choices=["fsdp2", "ddp", "single"])
    parser.add_argument("--resume-step", type=int, default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", default="")
    parser.add_argument("--width", type=int, default=10)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = train(args, rank, world) if args.mode == "train" else memory(args, rank, world)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run(sys.argv[1:])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Checkpoint save/load throughput against baselines measured in the same run.

    python benchmarks/bench_checkpoint.py [--mb 256] [--repeat 3] [--dir DIR] [--out results/bench/checkpoint.json]

State: ``--mb`` MB of fp32 tensors in total, a third in a model-like dict (layers of mixed shapes), two thirds
in Adam-like optimizer state (exp_avg, exp_avg_sq per parameter). Contenders, each writing fresh files into
its own fresh directory, interleaved round by round (median of ``--repeat`` rounds, after one warm-up round):

* ``raw``            the same tensor bytes written to one file per part with large writes + fsync (the limit)
* ``ours_sync``      CheckpointManager.save (manifest with sha256, fsyncs, atomic rename, latest)
* ``torch_save``     torch.save per part + fsync (no manifest, no hashing)
* ``dcp``            torch.distributed.checkpoint.save, single process (fsyncs by default)
* ``ours_async``     time until CheckpointManager(async_save=True).save returns (the training stall),
                     publication awaited outside the timing; snapshot buffers recycled after the first save
* loads: ours with sha256 verification, ours with size verification, torch.load of the torch.save files

Ratios: raw_time / contender_time for writers (1.0 = raw bandwidth), async stall / sync save time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from worldpipe.checkpoint import CheckpointManager
from worldpipe.checkpoint.publish import fsync_dir, write_all

MB = 1 << 20


def make_state(total_mb: int, seed: int = 0) -> dict:
    """A model-like dict holding a third of ``total_mb`` and Adam-like optimizer state holding the rest."""
    gen = torch.Generator().manual_seed(seed)
    per_part = total_mb * MB // 3 // 4  # fp32 elements in the model
    model: dict[str, torch.Tensor] = {}
    shapes = [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (50_000, 256)]
    left, i = per_part, 0
    while left > 0:
        shape = shapes[i % len(shapes)]
        numel = 1
        for dim in shape:
            numel *= dim
        if numel > left:
            shape, numel = (left,), left
        model[f"layers.{i}.{'bias' if len(shape) == 1 else 'weight'}"] = torch.randn(shape, generator=gen)
        left -= numel
        i += 1
    opt_state = {idx: {"step": torch.tensor(10.0), "exp_avg": torch.randn(p.shape, generator=gen),
                       "exp_avg_sq": torch.rand(p.shape, generator=gen)} for idx, p in enumerate(model.values())}
    optimizer = {"state": opt_state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                       "weight_decay": 0.0, "params": list(range(len(model)))}]}
    return {"model": model, "optimizer": optimizer, "progress": {"step": 0, "epoch": 0, "samples_seen": 0,
                                                                  "tokens_seen": 0}, "sampler": {"cursor": 0}}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def state_bytes(state: dict) -> int:
    """Total tensor bytes of the state."""
    return sum(t.numel() * t.element_size() for t in _tensors(state))


class Bench:
    """Fresh directories for every measurement, removed after it."""

    def __init__(self, base: Path, state: dict) -> None:
        self.base = base
        self.state = state
        self.counter = 0
        self.async_manager: CheckpointManager | None = None
        self.async_root = base / "async"
        self.load_root = base / "load"

    def fresh(self, name: str) -> Path:
        self.counter += 1
        path = self.base / f"{name}-{self.counter}"
        path.mkdir(parents=True)
        return path

    def raw(self) -> float:
        d = self.fresh("raw")
        parts = {"model": list(_tensors(self.state["model"])), "optimizer": list(_tensors(self.state["optimizer"]))}
        t0 = time.perf_counter()
        for name, tensors in parts.items():
            fd = os.open(d / f"{name}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            for t in tensors:
                write_all(fd, memoryview(t.numpy()).cast("B"))
            os.fsync(fd)
            os.close(fd)
        fsync_dir(str(d))
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def ours_sync(self) -> float:
        d = self.fresh("ours")
        cm = CheckpointManager(d / "checkpoints")
        t0 = time.perf_counter()
        cm.save(1, self.state)
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def torch_save(self) -> float:
        d = self.fresh("torchsave")
        t0 = time.perf_counter()
        for name in ("model", "optimizer"):
            path = d / f"{name}.pt"
            torch.save(self.state[name], path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fsync_dir(str(d))
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def dcp(self) -> float:
        import torch.distributed.checkpoint as dcp

        d = self.fresh("dcp")
        sd = {"model": self.state["model"], "optimizer": self.state["optimizer"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=str(d))
            dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def ours_async(self) -> float:
        if self.async_manager is None:
            self.async_manager = CheckpointManager(self.async_root, async_save=True, keep_last=2)
            self.async_step = 0
        self.async_step += 1
        t0 = time.perf_counter()
        self.async_manager.save(self.async_step, self.state)
        dt = time.perf_counter() - t0
        self.async_manager.wait()
        return dt

    def prepare_load(self) -> None:
        CheckpointManager(self.load_root).save(1, self.state)
        for name in ("model", "optimizer"):
            torch.save(self.state[name], self.load_root / f"{name}.pt")

    def load_sha256(self) -> float:
        t0 = time.perf_counter()
        CheckpointManager(self.load_root, verify="sha256").load(1)
        return time.perf_counter() - t0

    def load_size(self) -> float:
        t0 = time.perf_counter()
        CheckpointManager(self.load_root, verify="size").load(1)
        return time.perf_counter() - t0

    def torch_load(self) -> float:
        t0 = time.perf_counter()
        for name in ("model", "optimizer"):
            torch.load(self.load_root / f"{name}.pt", weights_only=True)
        return time.perf_counter() - t0


WRITERS = ("raw", "ours_sync", "torch_save", "dcp", "ours_async")
LOADERS = ("load_sha256", "load_size", "torch_load")


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; return (and write to ``args.out``) the results."""
    load_before = os.getloadavg()
    state = make_state(args.mb)
    nbytes = state_bytes(state)
    base_parent = Path(args.dir) if args.dir else Path("results/bench")
    base_parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=base_parent))
    bench = Bench(base, state)
    times: dict[str, list[float]] = {name: [] for name in WRITERS + LOADERS}
    try:
        for name in WRITERS:  # warm-up round: imports, thread pools, first-touch allocations
            getattr(bench, name)()
        first_async = None
        for _ in range(args.repeat):
            for name in WRITERS:  # interleaved: every contender sees the same machine conditions
                times[name].append(getattr(bench, name)())
        bench.prepare_load()
        for name in LOADERS:
            getattr(bench, name)()
        for _ in range(args.repeat):
            for name in LOADERS:
                times[name].append(getattr(bench, name)())
        cold = CheckpointManager(base / "async-cold", async_save=True)
        t0 = time.perf_counter()
        cold.save(1, state)
        first_async = time.perf_counter() - t0
        cold.close()
        if bench.async_manager is not None:
            bench.async_manager.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "state_mb": nbytes / MB,
        "repeat": args.repeat,
        "median_s": med,
        "all_s": times,
        "bandwidth_MBps": {name: nbytes / MB / med[name] for name in WRITERS if name != "ours_async"},
        "ratio_vs_raw": {name: med["raw"] / med[name] for name in ("ours_sync", "torch_save", "dcp")},
        "async_stall_over_sync": med["ours_async"] / med["ours_sync"],
        "async_first_save_stall_s": first_async,
        "async_first_stall_over_sync": first_async / med["ours_sync"],
        "load_ratio_vs_torch_load": {name: med["torch_load"] / med[name] for name in ("load_sha256", "load_size")},
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        # this benchmark is CPU-sensitive (hashing): record how busy the machine was
        "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    """CLI entry: parse arguments, run, print a summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="total state size in MB (model + optimizer)")
    parser.add_argument("--repeat", type=int, default=3, help="measured rounds (median reported)")
    parser.add_argument("--dir", default=None, help="where to write (default: results/bench/ckpt-bench-*)")
    parser.add_argument("--out", default="results/bench/checkpoint.json")
    result = run(parser.parse_args(argv))
    med = result["median_s"]
    print(f"state {result['state_mb']:.0f} MB, median of {result['repeat']}, "
          f"load average {result['loadavg_before_after'][0]:.1f} -> {result['loadavg_before_after'][1]:.1f}")
    for name in WRITERS[:-1]:
        ratio = f"  {result['ratio_vs_raw'][name]:.2f}x raw" if name in result["ratio_vs_raw"] else ""
        print(f"  {name:<11} {med[name]:.3f} s  {result['bandwidth_MBps'][name]:7.0f} MB/s{ratio}")
    print(f"  async stall {med['ours_async']:.3f} s = {result['async_stall_over_sync']:.2f}x sync save "
          f"(first save, cold buffers: {result['async_first_save_stall_s']:.3f} s)")
    for name in LOADERS:
        print(f"  {name:<11} {med[name]:.3f} s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""Sharded-save rows of `worldpipe bench checkpoint`; a torchrun script (bench_checkpoint.py launches it with
``worldpipe.launch.torchrun.torchrun_argv``), arguments ``--mb 256 --repeat 3 --dir DIR --out OUT``.

Every rank holds 1/N of a ``--mb`` MB state (the same model-like and Adam-like mix as bench_checkpoint.py) as
DTensors sharded on dim 0 over a 1-D mesh. Contenders, interleaved round by round, each into fresh
directories, timed from a barrier to the slowest rank's end (gathered):

* ``raw``            every rank writes its local bytes to one file with large writes + fsync (the limit)
* ``ours_sharded``   ShardedSaver.save: per-rank shard files with sha256, rank 0's manifest, rename, latest
* ``dcp``            torch.distributed.checkpoint.save of the same DTensor state dict
* ``async_stall``    ShardedSaver(async_save=True): time in ``save`` plus the wait before the optimizer
                     step after one simulated forward/backward (publication awaited outside the timing)

Aggregate bandwidth = total bytes / time; ratios raw_time / contender_time (1.0 = raw bandwidth).
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
import warnings
from argparse import Namespace
from pathlib import Path

import click
import torch
import torch.distributed as dist
from bench_checkpoint import MB, SimulatedStep, make_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from worldpipe.checkpoint import CheckpointManager
from worldpipe.checkpoint.sharded_saver import ShardedSaver
from worldpipe.commands.bench import Benchmark
from worldpipe.core.children import die_with_parent
from worldpipe.measure.write_baseline import state_bytes, write_raw

CONTENDERS = ("raw", "ours_sharded", "dcp", "async_stall")


def sharded_state(total_mb: int, mesh) -> tuple[dict, list[torch.Tensor]]:
    """This rank's 1/N of the state as DTensors (Shard(0)); also the local tensors (what the optimizer steps)."""
    world = mesh.size()
    local = make_state(max(1, total_mb // world), seed=dist.get_rank())
    locals_: list[torch.Tensor] = []

    def wrap(obj):
        if isinstance(obj, torch.Tensor) and obj.dim() > 0:
            locals_.append(obj)
            return DTensor.from_local(obj, mesh, [Shard(0)], run_check=False)
        if isinstance(obj, dict):
            return {k: wrap(v) for k, v in obj.items()}
        return obj

    state = {"model": wrap(local["model"]), "optimizer": wrap(local["optimizer"]),
             "progress": local["progress"], "sampler": local["sampler"], "rng": [], "identity": {}}
    return state, locals_


class ShardedBench:
    """Fresh directories per measurement, the same on every rank (rank 0 names them)."""

    def __init__(self, base: Path, state: dict, locals_: list[torch.Tensor], step_s: float) -> None:
        self.base, self.state, self.locals = base, state, locals_
        self.rank = dist.get_rank()
        self.counter = 0
        params = [torch.nn.Parameter(t, requires_grad=False) for t in locals_]
        self.optimizer = torch.optim.SGD(params, lr=0.0)  # its parameters' storage: every local tensor
        self.simulated = SimulatedStep(step_s)
        self.async_saver = ShardedSaver(CheckpointManager(base / "async", keep_last=2), async_save=True)
        self.async_step = 0
        self.stall_parts: list[list[float]] = []  # per round: [in save, waiting before the step, step time]

    def fresh(self, name: str) -> Path:
        self.counter += 1
        path = self.base / f"{name}-{self.counter}"
        if self.rank == 0:
            path.mkdir(parents=True)
        dist.barrier()
        return path

    def timed(self, fn) -> float:
        """Seconds from a common start to the slowest rank's end."""
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def raw(self) -> float:
        d = self.fresh("raw")

        return self._cleanup(d, self.timed(lambda: write_raw(d, {f"rank-{self.rank}.bin": self.locals})))

    def ours_sharded(self) -> float:
        d = self.fresh("ours")
        saver = ShardedSaver(CheckpointManager(d / "checkpoints"))
        return self._cleanup(d, self.timed(lambda: saver.save(1, self.state)))

    def dcp(self) -> float:
        import torch.distributed.checkpoint as dcp

        d = self.fresh("dcp")
        sd = {"model": self.state["model"], "optimizer": self.state["optimizer"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._cleanup(d, self.timed(lambda: dcp.save(sd, checkpoint_id=str(d))))

    def async_stall(self) -> float:
        self.async_step += 1
        dist.barrier()
        t0 = time.perf_counter()
        self.async_saver.save(self.async_step, self.state, self.optimizer)
        in_save = time.perf_counter() - t0
        step_time = self.simulated.run()
        t0 = time.perf_counter()
        self.async_saver.writer.before_optimizer_step()
        waited = time.perf_counter() - t0
        self.async_saver.manager.wait()
        parts = torch.tensor([in_save + waited, in_save, waited, step_time], dtype=torch.float64)
        dist.all_reduce(parts, op=dist.ReduceOp.MAX)
        self.stall_parts.append(parts[1:].tolist())
        return float(parts[0])

    def _cleanup(self, d: Path, seconds: float) -> float:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(d)
        return seconds


def run(args: Namespace) -> dict:
    """Measure every contender ``args.repeat`` times (after a warm-up round); rank 0 returns the summary."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state, locals_ = sharded_state(args.mb, mesh)
    per_rank = state_bytes({"l": locals_})
    bench = ShardedBench(Path(args.dir), state, locals_, args.step_s)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for name in CONTENDERS:
        getattr(bench, name)()
    for round_index in range(args.repeat):
        order = CONTENDERS[round_index % len(CONTENDERS):] + CONTENDERS[:round_index % len(CONTENDERS)]
        for name in order:
            times[name].append(getattr(bench, name)())
    bench.async_saver.manager.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    total = per_rank * dist.get_world_size()
    return {
        "ranks": dist.get_world_size(), "bytes_per_rank": per_rank, "median_s": med, "all_s": times,
        "aggregate_MBps": {name: total / MB / med[name] for name in ("raw", "ours_sharded", "dcp")},
        "ratio_vs_raw": {name: med["raw"] / med[name] for name in ("ours_sharded", "dcp")},
        "async_stall_over_sync": med["async_stall"] / med["ours_sharded"],
        # per measured round, max over ranks: seconds in save(), waiting for the copy, the simulated step
        "async_stall_parts_s": [dict(zip(("in_save", "wait_before_step", "step"), p, strict=True))
                                for p in bench.stall_parts[-args.repeat:]],
    }


OPTIONS = [
    click.Option(["--mb"], type=int, default=256, help="total state size in MB, all ranks together"),
    click.Option(["--repeat"], type=int, default=3, help="measured rounds (median reported)"),
    click.Option(["--dir"], required=True, help="where the contenders write"),
    click.Option(["--out"], required=True, help="JSON written by rank 0"),
    click.Option(["--step-s"], type=float, default=0.5, help="simulated forward/backward the async copy overlaps"),
]


def main(args: Namespace) -> None:
    """torchrun entry: join the gloo group, run, rank 0 writes ``--out``."""
    die_with_parent()  # torchrun starts each rank in a session of its own: the rank goes when torchrun does
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = run(args)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


# Not a `worldpipe bench` name of its own: bench_checkpoint.py starts it under torchrun.
COMMAND = Benchmark("checkpoint-sharded", __doc__, OPTIONS, main, prog="bench_checkpoint_sharded.py")

if __name__ == "__main__":
    COMMAND.script()

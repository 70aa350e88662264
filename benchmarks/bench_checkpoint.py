"""Checkpoint save/load throughput against baselines measured in the same run.

State: ``--mb`` MB of fp32 tensors in total, a third in a model-like dict (layers of mixed shapes), two thirds
in Adam-like optimizer state (exp_avg, exp_avg_sq per parameter). Contenders, each writing fresh files into
its own fresh directory, interleaved round by round (median of ``--repeat`` rounds, after one warm-up round):

* ``raw``            the same tensor bytes written to one file per part with large buffered writes + fsync
* ``direct_1``, ``direct_N``  the device's limit: as many bytes written with O_DIRECT (no page cache) by one
                     writer and by N writer threads (N = max(2, --ranks)), fsync; the faster of the two is
                     the limit every writer is also reported against (``fraction_of_device_limit``)
* ``ours_sync``      CheckpointManager.save (manifest with sha256, fsyncs, atomic rename, latest)
* ``torch_save``     torch.save per part + fsync (no manifest, no hashing)
* ``dcp``            torch.distributed.checkpoint.save, single process (fsyncs by default)
* ``ours_async``     time until CheckpointManager(async_save=True).save returns (the training stall),
                     publication awaited outside the timing; snapshot buffers recycled after the first save
* ``ours_async_overlap``  the stall of an async save whose copy of parameters and optimizer state overlaps
                     the next training step: time in ``save(..., optimizer=)`` plus the wait in
                     ``before_optimizer_step()`` after a simulated forward/backward (real matmuls calibrated
                     to ``--step-s`` seconds on an idle loop); how much slower that step ran is recorded too
* ``ours_async_added``  the whole cost of an async save to the training timeline: from ``save`` until the
                     publication is complete, simulated steps run back to back (each waiting for the copy as
                     the optimizer would); added time = that wall time - the same number of idle steps
                     (measured just before and just after, in the same round). Stall plus the slowdown of every overlapped
                     step: the headline ``async_added_over_sync`` (target <= 0.3 of a synchronous save)
* ``ours_async_added_normal_priority``  the same with the publication's threads at the training's CPU priority
                     (how async saves ran before they were lowered): the before of ``async_added_over_sync``
* sharded rows (``--ranks N`` > 0): ``benchmarks/bench_checkpoint_sharded.py`` under torchrun, N gloo ranks
  each holding 1/N of the same state: our sharded save vs N ranks' raw write+fsync of the same bytes vs DCP's
  ``save``, and the sharded async stall
* loads: ours with sha256 verification, ours with size verification, torch.load of the torch.save files

Ratios: raw_time / contender_time for writers (1.0 = raw bandwidth), async stall / sync save time. JSON to
``--out``, a plot of both (``checkpoint.png``) beside it, each written atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from argparse import Namespace
from pathlib import Path

import click
import torch

from worldpipe.checkpoint import CheckpointManager
from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.atomic import fsync_dir, write_text_atomic
from worldpipe.core.children import run_child
from worldpipe.core.figures import save_figure
from worldpipe.launch.torchrun import torchrun_argv
from worldpipe.measure.write_baseline import state_bytes, tensors_in, write_direct, write_raw

MB = 1 << 20
# The target for the training stall of an async save, drawn on the plot (not asserted anywhere).
TARGET_STALL_OVER_SYNC = 0.03
# The whole cost of an async save (stall + slowdown of the steps it overlaps), as a fraction of a sync save.
TARGET_ADDED_OVER_SYNC = 0.3


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


class SimulatedStep:
    """Forward/backward stand-in: real matmuls, calibrated once to take ``seconds`` on this machine."""

    def __init__(self, seconds: float, size: int = 384) -> None:
        self.a, self.b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(10):  # the first calls pay one-time setup
            torch.mm(self.a, self.b)
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            torch.mm(self.a, self.b)
            count += 1
        per_iteration = (time.perf_counter() - t0) / count
        self.iterations = max(1, round(seconds / per_iteration))

    def run(self) -> float:
        """Run the step; return how long it took."""
        t0 = time.perf_counter()
        for _ in range(self.iterations):
            torch.mm(self.a, self.b)
        return time.perf_counter() - t0


def optimizer_over(state: dict) -> torch.optim.Optimizer:
    """An optimizer whose parameters and per-parameter state are the state's tensors (storage shared)."""
    params = [torch.nn.Parameter(t, requires_grad=False) for t in state["model"].values()]
    optimizer = torch.optim.SGD(params, lr=0.0)
    for param, per_param in zip(params, state["optimizer"]["state"].values(), strict=True):
        optimizer.state[param] = per_param
    return optimizer


def added_time(manager, step: int, state: dict, optimizer, simulated: SimulatedStep) -> tuple[float, int, float]:
    """(time added to the timeline, steps overlapped, idle step) of one async save, steps run until it is published.

    The idle step is the mean of two steps right before the save and as many steps right after its publication as
    it overlapped (at least two): load drift during a long publication hits both sides alike.
    """
    before = [simulated.run(), simulated.run()]
    t0 = time.perf_counter()
    manager.save(step, state, optimizer=optimizer)
    steps = 0
    while True:
        simulated.run()
        manager.writer.before_optimizer_step()  # what optimizer.step()'s pre-hook does
        steps += 1
        if not manager.writer.publishing():
            break
    manager.wait()  # raises a failed publication
    wall = time.perf_counter() - t0
    after = [simulated.run() for _ in range(max(2, steps))]
    idle = (statistics.fmean(before) + statistics.fmean(after)) / 2
    return wall - steps * idle, steps, idle


def overlapped_stall(manager, step: int, state: dict, optimizer, simulated: SimulatedStep) -> tuple[float, float]:
    """(stall, step time) of an async save whose copy overlaps one simulated forward/backward."""
    t0 = time.perf_counter()
    manager.save(step, state, optimizer=optimizer)
    stall = time.perf_counter() - t0
    step_time = simulated.run()
    t0 = time.perf_counter()
    manager.writer.before_optimizer_step()  # what optimizer.step()'s pre-hook does
    return stall + time.perf_counter() - t0, step_time


class Bench:
    """Fresh directories for every measurement, removed after it."""

    def __init__(self, base: Path, state: dict) -> None:
        self.base = base
        self.state = state
        self.counter = 0
        self.async_manager: CheckpointManager | None = None
        self.async_root = base / "async"
        self.overlap_manager: CheckpointManager | None = None
        self.simulated: SimulatedStep | None = None
        self.step_times: list[float] = []
        # contender -> (steps overlapped, idle step) per whole-cost measurement
        self.added: dict[str, list[tuple[int, float]]] = {}
        self.added_managers: dict[str, list] = {}  # contender -> [manager, optimizer, last step]
        self.direct_writers = 2
        self.load_root = base / "load"

    def fresh(self, name: str) -> Path:
        self.counter += 1
        path = self.base / f"{name}-{self.counter}"
        path.mkdir(parents=True)
        return path

    def raw(self) -> float:
        d = self.fresh("raw")
        files = {f"{name}.bin": list(tensors_in(self.state[name])) for name in ("model", "optimizer")}
        t0 = time.perf_counter()
        write_raw(d, files)
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def direct(self, writers: int) -> float:
        d = self.fresh(f"direct{writers}")
        t0 = time.perf_counter()
        write_direct(d, state_bytes(self.state), writers)
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def direct_1(self) -> float:
        return self.direct(1)

    def direct_N(self) -> float:  # noqa: N802 - N writers, as the report names it
        return self.direct(self.direct_writers)

    def _added(self, name: str, background_priority: bool) -> float:
        if name not in self.added_managers:
            manager = CheckpointManager(self.base / name, async_save=True, keep_last=2,
                                        background_priority=background_priority)
            self.added_managers[name] = [manager, optimizer_over(self.state), 0]
        entry = self.added_managers[name]
        entry[2] += 1
        added, steps, idle = added_time(entry[0], entry[2], self.state, entry[1], self.simulated)
        self.added.setdefault(name, []).append((steps, idle))
        return added

    def ours_async_added(self) -> float:
        return self._added("ours_async_added", background_priority=True)

    def ours_async_added_normal_priority(self) -> float:
        # The before: the same async save with its writer, hash and fsync threads at the training's priority.
        return self._added("ours_async_added_normal_priority", background_priority=False)

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

    def ours_async_overlap(self) -> float:
        if self.overlap_manager is None:
            self.overlap_manager = CheckpointManager(self.base / "overlap", async_save=True, keep_last=2)
            self.optimizer, self.overlap_step = optimizer_over(self.state), 0
        self.overlap_step += 1
        stall, step_time = overlapped_stall(self.overlap_manager, self.overlap_step, self.state, self.optimizer,
                                            self.simulated)
        self.step_times.append(step_time)
        self.overlap_manager.wait()
        return stall

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


WRITERS = ("raw", "direct_1", "direct_N", "ours_sync", "torch_save", "dcp", "ours_async", "ours_async_overlap",
           "ours_async_added", "ours_async_added_normal_priority")
STALLS = ("ours_async", "ours_async_overlap", "ours_async_added", "ours_async_added_normal_priority")
LIMITS = ("direct_1", "direct_N")
LOADERS = ("load_sha256", "load_size", "torch_load")


def _measure(bench: Bench, repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in WRITERS + LOADERS}
    for name in WRITERS:  # warm-up round: imports, thread pools, first-touch allocations
        getattr(bench, name)()
    bench.step_times.clear()
    bench.added.clear()
    for round_index in range(repeat):
        # Interleaved, and rotated every round so no contender always runs first after an idle gap
        # (this VM pays page faults writing fresh files after idling).
        order = WRITERS[round_index % len(WRITERS):] + WRITERS[:round_index % len(WRITERS)]
        for name in order:
            times[name].append(getattr(bench, name)())
    bench.prepare_load()
    for name in LOADERS:
        getattr(bench, name)()
    for _ in range(repeat):
        for name in LOADERS:
            times[name].append(getattr(bench, name)())
    for manager in (bench.async_manager, bench.overlap_manager, *(e[0] for e in bench.added_managers.values())):
        if manager is not None:
            manager.close()
    return times


def _first_async_stall(base: Path, state: dict) -> float:
    cold = CheckpointManager(base / "async-cold", async_save=True)
    t0 = time.perf_counter()
    cold.save(1, state)
    first_async = time.perf_counter() - t0
    cold.close()
    return first_async


def run_sharded(args: Namespace, base: Path) -> dict | None:
    """The sharded rows: ``bench_checkpoint_sharded.py`` on ``args.ranks`` gloo ranks under torchrun."""
    if args.ranks < 1:
        return None
    out = base / "sharded.json"
    cmd = torchrun_argv(args.ranks, [str(Path(__file__).with_name("bench_checkpoint_sharded.py")), "--mb",
                                     str(args.mb), "--repeat", str(args.repeat), "--dir", str(base / "sharded"),
                                     "--out", str(out), "--step-s", str(args.step_s)])
    proc = run_child(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=args.sharded_timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"bench checkpoint: sharded rows failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def device_limit(med: dict, nbytes: int, writers: int) -> dict:
    """The device's write limit of this run: O_DIRECT with one and with N writers, the faster of the two."""
    best = min(LIMITS, key=lambda name: med[name])
    return {"writers": {"direct_1": 1, "direct_N": writers}, "median_s": {n: med[n] for n in LIMITS},
            "MBps": {n: nbytes / MB / med[n] for n in LIMITS}, "limit": best, "limit_s": med[best],
            "limit_MBps": nbytes / MB / med[best]}


def run(args: Namespace) -> dict:
    """Run the benchmark; return (and write to ``args.out``) the results."""
    load_before = os.getloadavg()
    # One intra-op thread, as a training rank runs (trainer.threads_per_rank): with more, an oversubscribed
    # machine makes the simulated step's duration erratic (its threads wait for each other at every matmul).
    torch.set_num_threads(1)
    state = make_state(args.mb)
    nbytes = state_bytes(state)
    base_parent = Path(args.dir) if args.dir else Path(args.out).parent
    base_parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=base_parent))
    bench = Bench(base, state)
    bench.simulated = SimulatedStep(args.step_s)
    bench.direct_writers = max(2, args.ranks)
    try:
        idle_step = statistics.median(bench.simulated.run() for _ in range(3))
        times = _measure(bench, args.repeat)
        first_async = _first_async_stall(base, state)
        sharded = run_sharded(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "state_mb": nbytes / MB,
        "repeat": args.repeat,
        "median_s": med,
        "all_s": times,
        "bandwidth_MBps": {name: nbytes / MB / med[name] for name in WRITERS if name not in STALLS},
        "ratio_vs_raw": {name: med["raw"] / med[name] for name in ("ours_sync", "torch_save", "dcp")},
        "async_stall_over_sync": med["ours_async"] / med["ours_sync"],
        "async_overlap_stall_over_sync": med["ours_async_overlap"] / med["ours_sync"],
        "simulated_step_s": {"idle": idle_step, "during_overlapped_copy": statistics.median(bench.step_times)},
        "async_added_over_sync": med["ours_async_added"] / med["ours_sync"],
        "async_added_normal_priority_over_sync": med["ours_async_added_normal_priority"] / med["ours_sync"],
        "async_added": {name: {"median_s": med[name], "steps_overlapped": [a[0] for a in rows],
                               "idle_step_s": [a[1] for a in rows]} for name, rows in bench.added.items()},
        "target_added_over_sync": TARGET_ADDED_OVER_SYNC,
        "device_limit": device_limit(med, nbytes, bench.direct_writers),
        "fraction_of_device_limit": {name: min(med[n] for n in LIMITS) / med[name]
                                     for name in ("raw", "ours_sync", "torch_save", "dcp")},
        "async_first_save_stall_s": first_async,
        "async_first_stall_over_sync": first_async / med["ours_sync"],
        "load_ratio_vs_torch_load": {name: med["torch_load"] / med[name] for name in ("load_sha256", "load_size")},
        "sharded": sharded,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        # this benchmark is CPU-sensitive (hashing): record how busy the machine was
        "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
        "target_stall_over_sync": TARGET_STALL_OVER_SYNC,
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result["plot"] = str(out.with_suffix(".png"))
        plot(result, out.with_suffix(".png"))
        write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    return result


def _draw_bars(ax, rows: list[tuple[str, float, str, bool]], sync_s: float, title: str,
               limit_s: float | None = None) -> None:
    """Horizontal bars (seconds, log scale) labelled with their ratio; stalls in a second colour."""
    names = [r[0] for r in rows]
    seconds = [r[1] for r in rows]
    colours = ["tab:orange" if r[3] else "tab:blue" for r in rows]
    ax.barh(names, seconds, color=colours)
    for y, (_, value, label, _) in enumerate(rows):
        ax.text(value, y, f" {label}", va="center", fontsize=8)
    ax.axvline(TARGET_STALL_OVER_SYNC * sync_s, color="k", ls="--", lw=1,
               label=f"target stall: {TARGET_STALL_OVER_SYNC}x sync save")
    if limit_s is not None:
        ax.axvline(limit_s, color="tab:green", ls=":", lw=1.5, label="device limit (O_DIRECT, best of 1 and N writers)")
        ax.axvline(TARGET_ADDED_OVER_SYNC * sync_s, color="tab:red", ls="--", lw=1,
                   label=f"target added time: {TARGET_ADDED_OVER_SYNC}x sync save")
    ax.set_xscale("log")
    ax.set_xlim(min(seconds + [TARGET_STALL_OVER_SYNC * sync_s]) / 2, max(seconds) * 8)
    ax.invert_yaxis()
    ax.set(xlabel="seconds (median; log scale)", title=title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)


def plot(result: dict, path: Path) -> None:
    """Sync vs async stall and every writer vs raw write+fsync; sharded rows beside them. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, ratio, bw = result["median_s"], result["ratio_vs_raw"], result["bandwidth_MBps"]
    limit, frac = result["device_limit"], result["fraction_of_device_limit"]
    steps = result["simulated_step_s"]  # the overlapped copy shares the CPU with the step: its cost moves there
    single = [(f"O_DIRECT, {limit['writers'][n]} writer(s)", med[n], f"{bw[n]:.0f} MB/s", False) for n in LIMITS]
    single += [("raw write+fsync", med["raw"], f"baseline, {bw['raw']:.0f} MB/s, {frac['raw']:.2f} of limit", False)]
    single += [(name, med[name], f"{ratio[name]:.2f}x raw, {bw[name]:.0f} MB/s, {frac[name]:.2f} of limit", False)
               for name in ("ours_sync", "torch_save", "dcp")]
    single += [("async stall", med["ours_async"], f"{result['async_stall_over_sync']:.2g}x sync", True),
               ("async stall, overlapped", med["ours_async_overlap"],
                f"{result['async_overlap_stall_over_sync']:.2g}x sync; step "
                f"{steps['during_overlapped_copy'] / steps['idle']:.1f}x idle", True),
               ("async: whole added time", max(med["ours_async_added"], 1e-6),
                f"{result['async_added_over_sync']:.2g}x sync (stall + slower steps)", True),
               ("async added, writer at normal priority", max(med["ours_async_added_normal_priority"], 1e-6),
                f"{result['async_added_normal_priority_over_sync']:.2g}x sync (the before)", True)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    _draw_bars(axes[0], single, med["ours_sync"], f"One process, {result['state_mb']:.0f} MB of state",
               limit_s=limit["limit_s"])
    sharded = result.get("sharded")
    if sharded:
        sm, sr, sbw = sharded["median_s"], sharded["ratio_vs_raw"], sharded["aggregate_MBps"]
        rows = [(f"raw write+fsync, {sharded['ranks']} ranks", sm["raw"], f"baseline, {sbw['raw']:.0f} MB/s", False),
                ("ours_sharded", sm["ours_sharded"], f"{sr['ours_sharded']:.2f}x raw, {sbw['ours_sharded']:.0f} MB/s",
                 False),
                ("dcp save", sm["dcp"], f"{sr['dcp']:.2f}x raw, {sbw['dcp']:.0f} MB/s", False),
                ("async stall, overlapped", sm["async_stall"], f"{sharded['async_stall_over_sync']:.2g}x sync",
                 True)]
        _draw_bars(axes[1], rows, sm["ours_sharded"],
                   f"Sharded: {sharded['ranks']} ranks x {sharded['bytes_per_rank'] / MB:.0f} MB each")
    else:
        axes[1].text(0.5, 0.5, "sharded rows skipped (--ranks 0)", ha="center", va="center")
        axes[1].set_axis_off()
    fig.suptitle("worldpipe bench checkpoint: writers vs raw write+fsync (x raw: raw time / writer time), "
                 "async stall / sync save", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def _print(result: dict) -> None:
    med = result["median_s"]
    print(f"state {result['state_mb']:.0f} MB, median of {result['repeat']}, "
          f"load average {result['loadavg_before_after'][0]:.1f} -> {result['loadavg_before_after'][1]:.1f}")
    for name in WRITERS:
        if name in STALLS:
            continue
        ratio = f"  {result['ratio_vs_raw'][name]:.2f}x raw" if name in result["ratio_vs_raw"] else ""
        print(f"  {name:<11} {med[name]:.3f} s  {result['bandwidth_MBps'][name]:7.0f} MB/s{ratio}")
    print(f"  async stall {med['ours_async']:.3f} s = {result['async_stall_over_sync']:.2g}x sync save "
          f"(first save, cold buffers: {result['async_first_save_stall_s']:.3f} s)")
    steps = result["simulated_step_s"]
    for name, key in (("ours_async_added", "async_added_over_sync"),
                      ("ours_async_added_normal_priority", "async_added_normal_priority_over_sync")):
        print(f"  {name}: whole added time (stall + slowdown of {result['async_added'][name]['steps_overlapped']} "
              f"overlapped steps): {med[name]:.4f} s = {result[key]:.3f}x sync save (target <= {TARGET_ADDED_OVER_SYNC})")
    limit = result["device_limit"]
    print(f"  device limit: O_DIRECT {limit['limit_MBps']:.0f} MB/s ({limit['limit']}); fraction of it: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["fraction_of_device_limit"].items()))
    print(f"  async stall, copy overlapping the next step: {med['ours_async_overlap']:.4f} s = "
          f"{result['async_overlap_stall_over_sync']:.4f}x sync save (simulated step {steps['idle']:.3f} s idle, "
          f"{steps['during_overlapped_copy']:.3f} s while copying)")
    for name in LOADERS:
        print(f"  {name:<11} {med[name]:.3f} s")
    sharded = result.get("sharded")
    if sharded:
        print(f"  sharded, {sharded['ranks']} ranks x {sharded['bytes_per_rank'] / MB:.0f} MB:")
        for name, bw in sharded["aggregate_MBps"].items():
            ratio = sharded["ratio_vs_raw"].get(name)
            print(f"    {name:<14} {sharded['median_s'][name]:.3f} s  {bw:7.0f} MB/s aggregate"
                  + (f"  {ratio:.2f}x raw" if ratio else ""))
        print(f"    async stall {sharded['median_s']['async_stall']:.4f} s = "
              f"{sharded['async_stall_over_sync']:.4f}x sharded sync save")


OPTIONS = [
    click.Option(["--mb"], type=int, default=256, help="total state size in MB (model + optimizer)"),
    click.Option(["--repeat"], type=int, default=5, help="measured rounds (median reported)"),
    click.Option(["--dir"], default=None, help="where to write (default: ckpt-bench-* beside --out)"),
    click.Option(["--out"], default=f"{BENCH_DIR}/checkpoint.json", help="JSON; the plot goes beside it (.png)"),
    click.Option(["--step-s"], type=float, default=0.5,
                 help="simulated forward/backward the async copy overlaps (seconds, idle machine)"),
    click.Option(["--ranks"], type=int, default=2, help="ranks of the sharded rows (0: skip them)"),
    click.Option(["--sharded-timeout-s"], type=float, default=1800, help="seconds the sharded rows may take"),
]


def check(args: Namespace) -> str | None:
    """What no single option's type rules out."""
    if args.mb < 1 or args.repeat < 1 or args.ranks < 0 or args.step_s <= 0:
        return "--mb and --repeat must be >= 1, --ranks >= 0, --step-s > 0"
    return None


def parse_args(argv: list[str] | None = None) -> Namespace:
    """Command-line options (the pipeline config's ``bench.checkpoint`` section sets them in the pipeline)."""
    return COMMAND.parse(argv)


def main(args: Namespace) -> dict:
    """Run with the command line's options, print a summary."""
    result = run(args)
    _print(result)
    return result


COMMAND = Benchmark("checkpoint", __doc__, OPTIONS, main, check)

if __name__ == "__main__":
    COMMAND.script()

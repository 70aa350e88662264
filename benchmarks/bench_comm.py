"""Communication and memory model of the parallel layouts, measured on the ranks available.

Starts ``--nproc`` ranks with torchrun (gloo on CPU, NCCL on GPUs) and measures, in the same run:

* ``all_reduce`` of 1 KB .. ``--max-mb`` MB (x2 steps), every sample a batch of calls lasting >= 5 ms (a
  1 KB call takes microseconds: one call per sample would time the clock and the barrier), ``--rounds`` samples
  per size, sizes interleaved round by round. A size's time is the **mean** of its samples, what a run pays per
  call; median and p10..p90 are kept beside it. On a 2-core VM a sample is bimodal (a rank that waits in gloo is
  either running or has to be woken by the hypervisor), so the median jumps between the modes from run to run
  (1 KB: 0.65 or 1.4 ms) while the mean of 60 samples moves by a few percent. Fitted with the ring model
  T(G) = 2(N-1)·alpha + 2(N-1)/N·beta·G piecewise, up to three regimes (latency-bound, cache-resident,
  memory-bound copies), each with its own alpha and beta and >= 3 sizes, breakpoints where the summed squared
  relative error over all sizes is least (least squares on relative error within each regime); the fit error
  per size, the largest error at >= 1 MB (target 15%) beside the measurement's own spread there, alpha fitted
  to odd and even samples separately (its stability), and the one-line fit over all sizes for comparison; plot ``comm_allreduce.png``.
* ring attention: bytes sent per rank (counted at the send calls) vs the model (N-1)·S·d_kv/N, with S the
  sequence length and d_kv the key+value bytes per position; forward time vs dense attention over the
  whole sequence on one rank (the baseline); plot ``comm_ring_bytes.png``.
* pipeline bubble: a GPipe schedule (``torch.distributed.pipelining``, P = N stages, M microbatches); idle
  fraction 1 - busy/T_step, busy timed inside each stage's forward and backward, averaged over stages, vs
  (P-1)/(M+P-1); plot ``comm_bubble.png``.
* memory per rank by tensor category (parameters, gradients, optimizer state, activations) of the causal
  transformer under ddp, fsdp2 and tp, measured from the tensors, beside the ZeRO formulas;
  plot ``comm_memory.png``.

JSON to ``--out``; PNGs beside it. The disagreements between model and measurement are discussed in
docs/parallel.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import click
import numpy as np
import torch
import torch.distributed as dist

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.atomic import write_text_atomic
from worldpipe.core.children import die_with_parent, run_child
from worldpipe.core.figures import save_figure
from worldpipe.launch.torchrun import torchrun_argv

KB = 1 << 10


def _timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up, every rank aligned by a barrier."""
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SAMPLE_S = 5e-3  # an all_reduce sample lasts at least this long (a batch of calls for small messages)


def _calls_per_sample(fn) -> int:
    """Calls of ``fn`` that take >= SAMPLE_S, agreed over ranks (each rank must make as many calls)."""
    start = time.perf_counter()
    fn()
    calls = torch.tensor([max(1, int(SAMPLE_S / max(time.perf_counter() - start, 1e-7)) + 1)])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    return min(int(calls), 10_000)


def measure_all_reduce(max_mb: int, rounds: int, device: torch.device, step: int = 2) -> list[dict]:
    """all_reduce seconds per call per message size (bytes of fp32, 1 KB .. ``max_mb`` MB, x``step``): mean, median
    and p10/p90 over ``rounds`` samples, each the slowest rank's (the collective ends when its last rank does).

    Sizes are interleaved: every round takes one sample of every size, so a change of the machine's load during
    the run shifts all sizes alike instead of bending the curve between neighbouring sizes.
    """
    for _ in range(10):  # gloo connects its pairs lazily: keep the first calls out of the smallest size
        dist.all_reduce(torch.ones(KB, device=device))
    sizes, size = [], KB
    while size <= max_mb << 20:
        sizes.append(size)
        size *= step
    buffers = {g: torch.ones(g // 4, device=device) for g in sizes}
    calls = {g: _calls_per_sample(_one_all_reduce(buffers[g], device)) for g in sizes}
    samples: dict[int, list[float]] = {g: [] for g in sizes}
    for _ in range(rounds):
        for g in sizes:
            samples[g].append(_sample(_one_all_reduce(buffers[g], device), calls[g]))
    slowest = torch.tensor([samples[g] for g in sizes], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = []
    for g, values in zip(sizes, slowest.tolist(), strict=True):
        rows.append({"bytes": g, "seconds": float(np.mean(values)), "median_s": float(np.median(values)),
                     "calls_per_sample": calls[g],
                     "samples_s": values, "p10_s": float(np.percentile(values, 10)),
                     "p90_s": float(np.percentile(values, 90))})
    return rows


def _one_all_reduce(buf: torch.Tensor, device: torch.device):
    def one() -> None:
        dist.all_reduce(buf)
        _sync(device)
    return one


def _sample(one, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``one``, every rank starting together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        one()
    return (time.perf_counter() - start) / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_ring_attention(repeat: int, device: torch.device) -> list[dict]:
    """Bytes sent per rank by the ring vs the model, and ring time vs dense attention of one chunk."""
    from worldpipe.parallel.ring_attention import RingStats, ring_attention

    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for seq, heads, head_dim in ((256, 4, 32), (1024, 4, 32), (4096, 4, 32)):
        chunk = seq // n
        q, k, v = (torch.randn(1, heads, chunk, head_dim, device=device) for _ in range(3))
        stats = RingStats()
        ring_attention(q, k, v, stats=stats)
        d_kv = 2 * heads * head_dim * k.element_size()  # key + value bytes per position
        ring_s = _timed(lambda q=q, k=k, v=v: ring_attention(q, k, v), repeat)
        # Baseline: what the ring replaces, dense causal attention over the whole sequence on one rank.
        full = [torch.randn(1, heads, seq, head_dim, device=device) for _ in range(3)]
        dense_s = _timed(lambda full=full: torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True),
                         repeat)
        rows.append({"rank": rank, "seq": seq, "d_kv_bytes": d_kv, "bytes_sent": stats.bytes_sent_forward,
                     "model_bytes": (n - 1) * seq * d_kv // n, "blocks_skipped": stats.blocks_skipped,
                     "ring_s": ring_s, "dense_full_s": dense_s})
    return rows


class _Stamp(torch.autograd.Function):
    """Identity whose backward records the time it runs: marks where a stage's backward starts and ends."""

    @staticmethod
    def forward(ctx, x, marks, key):  # noqa: D102
        ctx.marks, ctx.key = marks, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        ctx.marks.append((ctx.key, time.perf_counter()))
        return grad, None, None


class TimedStage(torch.nn.Module):
    """A pipeline stage that accumulates the seconds it computes (forward, and backward between its stamps)."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.inner = torch.nn.Sequential(*layers)
        self.forward_s, self.marks = 0.0, []

    def forward(self, x):  # noqa: D102
        x = x if x.requires_grad else x.detach().requires_grad_()  # so the first stage's backward is stamped too
        start = time.perf_counter()
        y = self.inner(_Stamp.apply(x, self.marks, "end"))
        self.forward_s += time.perf_counter() - start
        return _Stamp.apply(y, self.marks, "start")

    def take_busy(self) -> float:
        """Seconds computed since the last call (forward + backward), and reset."""
        starts = [t for key, t in self.marks if key == "start"]
        ends = [t for key, t in self.marks if key == "end"]
        busy = self.forward_s + sum(e - s for s, e in zip(starts, ends, strict=True))
        self.forward_s, self.marks[:] = 0.0, []
        return busy


def measure_bubble(repeat: int, device: torch.device, batch: int = 256, width: int = 512) -> list[dict]:
    """GPipe over all ranks (one stage each): measured idle fraction per microbatch count vs (P-1)/(M+P-1).

    Idle = 1 - (seconds the stage computed) / (step time), from timestamps taken inside the stage's forward
    and backward, averaged over the stages.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    module = TimedStage(width, 8).to(device)
    rows = []
    for micro in (1, 2, 4, 8, 16):
        stage = PipelineStage(module, rank, stages, device)
        schedule = ScheduleGPipe(stage, micro, loss_fn=lambda out, target: (out - target).pow(2).mean())
        x, target = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)

        def step(schedule=schedule, x=x, target=target):
            if rank == 0:
                schedule.step(x)
            elif rank == stages - 1:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            _sync(device)

        step(), module.take_busy()  # warm-up
        idle = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            idle.append(1.0 - module.take_busy() / elapsed)
        mine = torch.tensor([statistics.median(idle)])
        dist.all_reduce(mine)
        rows.append({"microbatches": micro, "stages": stages, "idle_measured": float(mine) / stages,
                     "idle_model": (stages - 1) / (micro + stages - 1)})
    return rows


def _planned_sharded_parameters(model: torch.nn.Module) -> int:
    """Parameters the tensor-parallel plan splits: column-wise weight and bias, row-wise weight (its bias is
    replicated, added once after the all-reduce)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    params = dict(model.named_parameters())
    count = 0
    for path, style in model.tensor_parallel_plan().items():
        count += params[f"{path}.weight"].numel()
        if isinstance(style, ColwiseParallel):
            count += params[f"{path}.bias"].numel()
    return count


def measure_layout_memory(device: torch.device) -> dict:
    """Bytes per rank by category of the transformer under ddp, fsdp2 and tp, and the ZeRO formulas."""
    from worldpipe.models.transformer import CausalTransformer
    from worldpipe.parallel.layout import build_layout
    from worldpipe.parallel.memory import measure_memory, zero_formulas
    from worldpipe.parallel.runtime import init_runtime

    runtime, n = init_runtime(), dist.get_world_size()
    heads = 4 if 4 % n == 0 else n
    sizes = {"width": 128, "heads": heads, "layers": 2, "mlp_ratio": 4}
    obs = torch.randn(8, 64, 3, device=device)
    action, reward, mask = torch.randn(8, 64, 1, device=device), torch.randn(8, 64, device=device), torch.ones(8, 64, device=device)
    measured = {}
    for name, cfg in {"ddp": ("ddp", 1), "fsdp2": ("fsdp2", 1), "tp": ("none", n)}.items():
        torch.manual_seed(0)
        core = CausalTransformer(3, 1, **sizes).to(device)
        params = sum(p.numel() for p in core.parameters())
        tp_params = _planned_sharded_parameters(core)
        layout = build_layout({"strategy": cfg[0], "tensor_parallel": cfg[1], "context_parallel": 1}, runtime)
        model = layout.wrap(core)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **layout.optimizer_kwargs)
        rows = obs.shape[0] // layout.dp_size
        sl = slice(layout.dp_rank * rows, (layout.dp_rank + 1) * rows)
        measured[name] = measure_memory(model, optimizer,
                                        lambda sl=sl, model=model: model(obs[sl], action[sl], reward[sl], mask[sl], None)["total"])
    return {"model": sizes, "parameters": params, "tp_sharded_parameters": tp_params, "measured": measured,
            "formula": zero_formulas(params, tp_params, n)}


def worker(out: Path, max_mb: int, rounds: int, repeat: int) -> None:
    """Every rank: run the measurements; rank 0 writes the raw rows."""
    die_with_parent()  # torchrun starts each rank in a session of its own: the rank goes when torchrun does
    from worldpipe.parallel.runtime import init_runtime

    torch.set_num_threads(1)
    runtime = init_runtime()
    raw = {"world_size": runtime.world_size, "backend": dist.get_backend(), "device": str(runtime.device),
           "all_reduce": measure_all_reduce(max_mb, rounds, runtime.device)}
    ring = measure_ring_attention(repeat, runtime.device)
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, ring)
    raw["ring_attention"] = [row for rows in gathered for row in rows]
    raw["pipeline_bubble"] = measure_bubble(repeat, runtime.device)
    raw["memory"] = measure_layout_memory(runtime.device)
    if runtime.is_main:
        out.write_text(json.dumps(raw))
    dist.destroy_process_group()


LARGE_MESSAGE = 1 << 20  # the target's "messages >= 1 MB"
TARGET_FIT_ERROR = 0.15


def fit_ring_model(rows: list[dict], n: int) -> dict:
    """alpha, beta of T(G) = 2(N-1)·alpha + 2(N-1)/N·beta·G minimizing the relative error; error per size."""
    sizes = np.array([r["bytes"] for r in rows], dtype=float)
    times = np.array([r["seconds"] for r in rows], dtype=float)
    from scipy.optimize import nnls

    design = np.stack([np.full_like(sizes, 2 * (n - 1)), 2 * (n - 1) / n * sizes], axis=1) / times[:, None]
    # Non-negative: a noisy run (few sizes, one repeat) would otherwise fit a negative latency or bandwidth.
    (alpha, beta), _ = nnls(design, np.ones_like(times))
    predicted = 2 * (n - 1) * alpha + 2 * (n - 1) / n * beta * sizes
    errors = predicted / times - 1.0
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "bandwidth_GBps": float(1.0 / beta / 1e9) if beta > 0 else None,
            "model_s": predicted.tolist(), "fit_error_per_size": errors.tolist(),
            "max_abs_fit_error": float(np.max(np.abs(errors)))}


MAX_REGIMES = 3  # latency-bound, cache-resident copies, memory-bound copies (the CPU's L2 and L3 bound them)
MIN_SIZES_PER_REGIME = 3  # a line through two points fits them exactly and says nothing
# More regimes never fit worse, and the hardware has all three, so a partition with more regimes is preferred
# unless it ties (exact timings fit with fewer: both sums are zero up to rounding).
REGIME_TIE = 1e-12


def _partitions(count: int, regimes: int, least: int):
    """Every split of ``count`` ordered sizes into ``regimes`` contiguous runs of >= ``least`` sizes (start indices)."""
    if regimes == 1:
        yield (0,)
        return
    for first in range(least, count - least * (regimes - 1) + 1):
        for rest in _partitions(count - first, regimes - 1, least):
            yield (0, *(first + i for i in rest))


def fit_regimes(rows: list[dict], n: int) -> dict:
    """The ring model fitted piecewise: up to MAX_REGIMES size ranges, each with its own alpha and beta.

    Breakpoints are fitted: every split into contiguous ranges of >= MIN_SIZES_PER_REGIME sizes is tried and the one
    with the least sum of squared relative errors wins, the objective each regime's own fit minimizes (a partition
    with more regimes unless the sums tie). Not the worst error: one noisy latency-bound size would then choose
    the breakpoints for every size (two quiet runs, the same samples: 15% and 14% at >= 1 MB
    with breakpoints by the worst error, 3.4% and 2.2% by the sum). Writes
    ``model_s``, ``fit_error`` and ``regime`` (index) into every row; returns every regime's fit, the breakpoints,
    the errors, and the measurement's own spread at >= 1 MB (the larger distance of p10 or p90 from the mean, over
    the mean): how far one sample strays from what the model predicts.
    """
    best = None
    for regimes in range(1, MAX_REGIMES + 1):
        for starts in _partitions(len(rows), regimes, MIN_SIZES_PER_REGIME):
            bounds = [*starts, len(rows)]
            parts = [fit_ring_model(rows[a:b], n) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            squared = sum(float(np.sum(np.square(p["fit_error_per_size"]))) for p in parts)
            if best is None or squared < best[0] - (REGIME_TIE if regimes > len(best[1]) else 0):
                best = (squared, starts, parts)
    if best is None:  # too few sizes for even one regime of MIN_SIZES_PER_REGIME: one line through them
        best = (None, (0,), [fit_ring_model(rows, n)])
    _, starts, parts = best
    bounds = [*starts, len(rows)]
    for index, (a, b, part) in enumerate(zip(bounds[:-1], bounds[1:], parts, strict=True)):
        for row, model_s in zip(rows[a:b], part["model_s"], strict=True):
            row.update(model_s=float(model_s), fit_error=float(model_s / row["seconds"] - 1.0), regime=index)
    large = [r for r in rows if r["bytes"] >= LARGE_MESSAGE]
    spread = [max(r["seconds"] - r["p10_s"], r["p90_s"] - r["seconds"]) / r["seconds"] for r in large]
    regimes = [{**_regime_summary(part), "from_bytes": rows[a]["bytes"], "to_bytes": rows[b - 1]["bytes"]}
               for a, b, part in zip(bounds[:-1], bounds[1:], parts, strict=True)]
    return {"alpha_s": parts[0]["alpha_s"], "beta_s_per_byte": parts[0]["beta_s_per_byte"],
            "bandwidth_GBps": parts[0]["bandwidth_GBps"], "regimes": len(parts), "per_regime": regimes,
            "split_bytes": [rows[a]["bytes"] for a in starts[1:]],
            "max_abs_fit_error": max(abs(r["fit_error"]) for r in rows),
            "max_abs_fit_error_ge_1MB": max(abs(r["fit_error"]) for r in large) if large else None,
            "measurement_spread_ge_1MB": max(spread) if spread else None,
            "target_fit_error_ge_1MB": TARGET_FIT_ERROR}


def alpha_halves(rows: list[dict], n: int) -> dict:
    """Is alpha stable? The first regime fitted to the means of the odd and of the even samples separately."""
    fit = {}
    for name, pick in (("odd", slice(0, None, 2)), ("even", slice(1, None, 2))):
        half = [{"bytes": r["bytes"], "seconds": float(np.mean(r["samples_s"][pick]))} for r in rows
                if r["samples_s"][pick]]
        fit[name] = fit_ring_model(half[:MIN_SIZES_PER_REGIME], n)["alpha_s"] if len(half) == len(rows) else None
    ratio = fit["odd"] / fit["even"] if fit["odd"] and fit["even"] else None
    return {"alpha_s_odd_samples": fit["odd"], "alpha_s_even_samples": fit["even"], "ratio": ratio}


def _regime_summary(fit: dict) -> dict:
    return {k: fit[k] for k in ("alpha_s", "beta_s_per_byte", "bandwidth_GBps", "max_abs_fit_error")}


def describe_fit(fit: dict) -> str:
    """The fitted ring model in words; a bandwidth the timings cannot resolve is said so, not printed as a number."""
    if "per_regime" in fit:
        return "; ".join(f"{r['from_bytes'] / KB:.0f} KB..{r['to_bytes'] / KB:.0f} KB: {describe_fit(r)}"
                         for r in fit["per_regime"])
    bandwidth = (f"{fit['bandwidth_GBps']:.2f} GB/s" if fit["bandwidth_GBps"] is not None
                 else "bandwidth not resolved by these sizes")
    return f"alpha {fit['alpha_s'] * 1e6:.1f} us, {bandwidth}"


def summarize(raw: dict) -> dict:
    """Fits, ratios against the same-run baselines, and the headline numbers."""
    n = raw["world_size"]
    result = dict(raw)
    one_line = fit_ring_model(raw["all_reduce"], n)
    result["all_reduce_fit_one_line"] = {k: v for k, v in one_line.items() if k != "model_s"}
    result["all_reduce_fit"] = fit_regimes(raw["all_reduce"], n)
    result["all_reduce_fit"]["alpha_stability"] = alpha_halves(raw["all_reduce"], n)
    for row in raw["ring_attention"]:
        row["bytes_ratio_to_model"] = row["bytes_sent"] / row["model_bytes"] if row["model_bytes"] else None
        row["ring_over_dense_full"] = row["ring_s"] / row["dense_full_s"]
    mem = raw["memory"]
    mem["measured_over_formula"] = {
        layout: {cat: mem["measured"][layout][cat] / value for cat, value in cats.items() if value}
        for layout, cats in mem["formula"].items()}
    return result


def _figure(folder: Path, name: str, draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.legend()
    fig.tight_layout()
    path = folder / name
    save_figure(fig, path, dpi=110)
    return str(path)


def _draw_all_reduce(result: dict):
    rows, fit = result["all_reduce"], result["all_reduce_fit"]

    def draw(ax):
        sizes = [r["bytes"] for r in rows]
        mean = np.array([r["seconds"] for r in rows])
        spread = [mean - [r.get("p10_s", r["seconds"]) for r in rows],
                  np.array([r.get("p90_s", r["seconds"]) for r in rows]) - mean]
        ax.errorbar(sizes, mean, yerr=spread, fmt="o", capsize=3, label="measured (mean, p10..p90)")
        for index, regime in enumerate(fit["per_regime"]):
            part = [r for r in rows if r["regime"] == index]
            ax.plot([r["bytes"] for r in part], [r["model_s"] for r in part], ("-", "--", ":")[index % 3],
                    label=f"ring model, {regime['from_bytes'] / KB:.0f}..{regime['to_bytes'] / KB:.0f} KB")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for r in rows:
            ax.annotate(f"{r['fit_error']:+.0%}", (r["bytes"], r["model_s"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 6), ha="center")
        worst, spread = fit["max_abs_fit_error_ge_1MB"], fit["measurement_spread_ge_1MB"]
        ax.set(xlabel="message size (bytes)", ylabel="all_reduce time per call (s)",
               title=f"all_reduce on {result['world_size']} ranks ({result['backend']}): "
                     + (f"worst model error >= 1 MB {worst:.0%}, measurement spread there {spread:.0%}"
                        if worst is not None else "no message >= 1 MB"))
        ax.title.set_fontsize(9)
    return draw


def _draw_ring(result: dict):
    ring = [r for r in result["ring_attention"] if r["rank"] == 0]

    def draw(ax):
        ax.plot([r["seq"] for r in ring], [r["bytes_sent"] for r in ring], "o", label="measured (rank 0)")
        ax.plot([r["seq"] for r in ring], [r["model_bytes"] for r in ring], "-", label="(N-1)·S·d_kv/N")
        ax.set(xlabel="sequence length S", ylabel="bytes sent per rank (forward)", title="Ring attention traffic")
    return draw


def _draw_bubble(result: dict):
    bubble = result["pipeline_bubble"]

    def draw(ax):
        micro = [r["microbatches"] for r in bubble]
        ax.plot(micro, [r["idle_measured"] for r in bubble], "o-", label="measured")
        ax.plot(micro, [r["idle_model"] for r in bubble], "--", label="(P-1)/(M+P-1)")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="microbatches M", ylabel="idle fraction", title=f"GPipe bubble, P={bubble[0]['stages']} stages")
    return draw


def _draw_memory(result: dict):
    mem, cats = result["memory"], ("parameters", "gradients", "optimizer_state", "activations")

    def draw(ax):
        width = 0.8 / len(mem["measured"])
        for i, layout in enumerate(mem["measured"]):
            xs = np.arange(len(cats)) + i * width
            ax.bar(xs, [mem["measured"][layout][c] / KB for c in cats], width, label=f"{layout} measured")
            ax.plot(xs[:3], [mem["formula"][layout][c] / KB for c in cats[:3]], "k_", markersize=14)
        ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats)
        ax.set(ylabel="KiB per rank", title="Memory per rank by category (bars: tensors; black marks: ZeRO formulas)")
    return draw


def plot(result: dict, folder: Path) -> list[str]:
    """The four measured-vs-model figures."""
    return [_figure(folder, "comm_allreduce.png", _draw_all_reduce(result)),
            _figure(folder, "comm_ring_bytes.png", _draw_ring(result)),
            _figure(folder, "comm_bubble.png", _draw_bubble(result)),
            _figure(folder, "comm_memory.png", _draw_memory(result))]


OPTIONS = [
    click.Option(["--nproc"], type=int, default=2, help="ranks (>= 2)"),
    click.Option(["--max-mb"], type=int, default=64, help="largest all_reduce message in MB"),
    click.Option(["--rounds"], type=int, default=60, help="all_reduce samples per size (mean), sizes interleaved"),
    click.Option(["--repeat"], type=int, default=15, help="timed repetitions per point of ring attention and GPipe"),
    click.Option(["--out"], default=f"{BENCH_DIR}/comm.json", help="JSON result (its plots beside it)"),
    click.Option(["--worker"], default=None, hidden=True),  # one rank's process (internal)
]


def check(args: Namespace) -> str | None:
    """What no single option's type rules out."""
    if not args.worker and args.nproc < 2:
        return "--nproc must be at least 2 (communication needs two ranks)"
    if min(args.max_mb, args.rounds, args.repeat) < 1:
        return "--max-mb, --rounds and --repeat must be at least 1"
    return None


def parse_args(argv: list[str] | None = None) -> Namespace:
    """Command-line options (the pipeline config's ``bench.comm`` section sets them in the pipeline)."""
    return COMMAND.parse(argv)


def main(args: Namespace) -> dict | None:
    """Launch the ranks, then fit, plot and write the JSON."""
    if args.worker:
        worker(Path(args.worker), args.max_mb, args.rounds, args.repeat)
        return None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = torchrun_argv(args.nproc, [__file__, "--worker", str(raw_path), "--max-mb", str(args.max_mb),
                                         "--rounds", str(args.rounds), "--repeat", str(args.repeat)])
        run_child(cmd, check=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        result = summarize(json.loads(raw_path.read_text()))
    result["plots"] = plot(result, out.parent)
    write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    fit = result["all_reduce_fit"]
    worst = fit["max_abs_fit_error_ge_1MB"]
    print(f"all_reduce ring model on {result['world_size']} ranks, {fit['regimes']} regime(s): {describe_fit(fit)}; "
          f"max fit error {fit['max_abs_fit_error']:.0%}, at >= 1 MB "
          + (f"{worst:.0%} (target <= {TARGET_FIT_ERROR:.0%}; the measurement's own spread there: "
             f"{fit['measurement_spread_ge_1MB']:.0%})" if worst is not None else "n/a")
          + f"; one line over all sizes: {result['all_reduce_fit_one_line']['max_abs_fit_error']:.0%}; "
          f"alpha from odd / even samples: {fit['alpha_stability']['ratio'] or float('nan'):.2f}")
    for row in result["all_reduce"]:
        print(f"  {row['bytes']:>10} B  {row['seconds'] * 1e6:10.1f} us  model {row['model_s'] * 1e6:10.1f} us  "
              f"error {row['fit_error']:+.1%}  (regime {row['regime']}, p10..p90 {row['p10_s'] * 1e6:.1f}..{row['p90_s'] * 1e6:.1f})")
    for row in result["ring_attention"]:
        if row["rank"] == 0:
            print(f"ring attention S={row['seq']}: bytes/model {row['bytes_ratio_to_model']:.3f}, "
                  f"ring time / dense full-sequence time {row['ring_over_dense_full']:.2f}")
    for row in result["pipeline_bubble"]:
        print(f"GPipe P={row['stages']} M={row['microbatches']}: idle {row['idle_measured']:.2f} "
              f"(model {row['idle_model']:.2f})")
    for layout, ratios in result["memory"]["measured_over_formula"].items():
        print(f"memory {layout}: measured/formula " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"wrote {out}")
    return result


COMMAND = Benchmark("comm", __doc__, OPTIONS, main, check)

if __name__ == "__main__":
    COMMAND.script()

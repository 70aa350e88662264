"""The pipeline bubble in real training steps: per-stage busy and idle time against (P-1)/(M+P-1).

Starts ``--nproc`` ranks with torchrun (one pipeline stage each: P = nproc) and trains the causal transformer
through the ``pp`` layout itself (``build_layout`` → ``wrap`` → ``forward_backward``, then clipping and the
AdamW step), at M = 1, 2, 4, 8 microbatches of the same global batch. Per stage and step:

* busy: seconds inside the stage's forward and backward of each microbatch (timed around the stage's
  ``forward_one_chunk``/``backward_one_chunk``: arithmetic only, no transfers);
* step: seconds of the schedule (forward and backward of every microbatch, transfers and waits included);
* idle = 1 - busy/step, against the GPipe bubble (P-1)/(M+P-1);
* communication, measured separately: the same activation (and gradient) tensors sent between neighbouring
  stages in isolation (ping-pong, one way = half the round trip), times the transfers a stage makes per step
  (M activations and M gradients per boundary it touches), so that idle - comm/step is the part of the idle
  time the transfers do not explain.

JSON to ``--out`` (medians over ``--repeat`` steps after a warm-up); ``pipeline.png`` beside it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import click
import torch
import torch.distributed as dist

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.children import die_with_parent, run_child
from worldpipe.core.figures import save_figure
from worldpipe.launch.torchrun import torchrun_argv
from worldpipe.measure.publish import publish_result

MICROBATCHES = (1, 2, 4, 8)
SIZES = {"width": 128, "heads": 4, "mlp_ratio": 4}
BATCH, WINDOW, OBS, ACT = 32, 32, 3, 1


def _timed_methods(stage, clock: list[float]) -> None:
    """Add the seconds of every forward/backward chunk of ``stage`` to ``clock[0]``."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - start
        setattr(stage, name, timed)


def _batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(BATCH, WINDOW, OBS, generator=gen), "action": torch.randn(BATCH, WINDOW, ACT, generator=gen),
            "reward": torch.randn(BATCH, WINDOW, generator=gen), "mask": torch.ones(BATCH, WINDOW), "noise": None}


def measure_steps(runtime, stages: int, micro: int, schedule: str, repeat: int) -> dict:
    """Busy and step seconds of this rank's stage over ``repeat`` training steps at ``micro`` microbatches."""
    from worldpipe.models.transformer import CausalTransformer
    from worldpipe.parallel.layout import build_layout

    torch.manual_seed(0)
    core = CausalTransformer(OBS, ACT, layers=2 * stages, **SIZES)
    layout = build_layout({"strategy": "none", "pipeline_parallel": stages, "microbatches": micro,
                           "pipeline_schedule": schedule}, runtime)
    model = layout.wrap(core)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clock = [0.0]
    _timed_methods(layout.pipeline.stage, clock)
    batch = _batch(1)
    busy, step, whole = [], [], []
    for index in range(repeat + 1):  # the first step (shape inference, allocation) is not counted
        dist.barrier()
        clock[0], start = 0.0, time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        layout.forward_backward(model, batch, BATCH * WINDOW, core.loss_terms)
        scheduled = time.perf_counter() - start
        layout.clip_grad_norm(model.parameters(), 100.0)
        optimizer.step()
        if index:
            busy.append(clock[0])
            step.append(scheduled)
            whole.append(time.perf_counter() - start)
    return {"busy_s": statistics.median(busy), "step_s": statistics.median(step),
            "train_step_s": statistics.median(whole)}


def measure_transfer(runtime, stages: int, micro: int, repeat: int) -> float:
    """One-way seconds of one microbatch's activation between neighbouring stages (ping-pong, in isolation)."""
    rank = runtime.rank
    tensor = torch.randn(BATCH // micro, WINDOW, SIZES["width"])
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        for left in range(stages - 1):  # every boundary in turn: left sends, right returns it
            if rank == left:
                dist.send(tensor, left + 1)
                dist.recv(tensor, left + 1)
            elif rank == left + 1:
                dist.recv(tensor, left)
                dist.send(tensor, left)
        times.append((time.perf_counter() - start) / (2 * (stages - 1)))
    return statistics.median(times[1:])


def worker(out: Path, repeat: int, schedule: str) -> None:
    """Every rank: measure each M; rank 0 writes the raw rows."""
    die_with_parent()  # torchrun starts each rank in a session of its own: the rank goes when torchrun does
    from worldpipe.parallel.runtime import init_runtime

    torch.set_num_threads(1)
    runtime = init_runtime()
    stages, rows = runtime.world_size, []
    for micro in MICROBATCHES:
        mine = measure_steps(runtime, stages, micro, schedule, repeat)
        one_way = measure_transfer(runtime, stages, micro, repeat)
        boundaries = (runtime.rank > 0) + (runtime.rank < stages - 1)
        mine.update(stage=runtime.rank, transfer_one_way_s=one_way, transfers=2 * micro * boundaries)
        gathered = [None] * stages
        dist.all_gather_object(gathered, mine)
        rows.append({"microbatches": micro, "stages": stages, "per_stage": gathered})
    if runtime.is_main:
        out.write_text(json.dumps({"world_size": stages, "schedule": schedule, "backend": dist.get_backend(),
                                   "model": {**SIZES, "layers": 2 * stages}, "batch": BATCH, "window": WINDOW,
                                   "rows": rows}))
    dist.destroy_process_group()


def summarize(raw: dict) -> dict:
    """Idle fractions per stage and averaged, the bubble model, and the share of idle time communication explains."""
    for row in raw["rows"]:
        p, m = row["stages"], row["microbatches"]
        for s in row["per_stage"]:
            s["idle"] = 1.0 - s["busy_s"] / s["step_s"]
            s["comm_s"] = s["transfers"] * s["transfer_one_way_s"]
            s["comm_fraction"] = s["comm_s"] / s["step_s"]
        row["idle_measured"] = statistics.mean(s["idle"] for s in row["per_stage"])
        row["comm_fraction"] = statistics.mean(s["comm_fraction"] for s in row["per_stage"])
        row["idle_minus_comm"] = row["idle_measured"] - row["comm_fraction"]
        row["idle_model"] = (p - 1) / (m + p - 1)
    return raw


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    micro = [r["microbatches"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(micro, [r["idle_measured"] for r in rows], "o-", label="idle, measured (mean over stages)")
    for stage in range(result["world_size"]):  # each stage's own idle fraction, to see which stage waits
        ax.plot(micro, [r["per_stage"][stage]["idle"] for r in rows], ".", alpha=0.6,
                label=f"idle, stage {stage}")
    ax.plot(micro, [r["idle_minus_comm"] for r in rows], "s--", label="idle minus communication (measured apart)")
    ax.plot(micro, [r["idle_model"] for r in rows], "k:", label="(P-1)/(M+P-1)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="microbatches M", ylabel="fraction of the step",
           title=f"Pipeline bubble in training steps: P={result['world_size']}, {result['schedule']}, "
                 f"{result['backend']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


OPTIONS = [
    click.Option(["--nproc"], type=int, default=2, help="ranks = pipeline stages (>= 2)"),
    click.Option(["--repeat"], type=int, default=5, help="timed steps per M (median)"),
    click.Option(["--schedule"], type=click.Choice(("gpipe", "1f1b")), default="gpipe", help="pipeline schedule"),
    click.Option(["--out"], type=click.Path(path_type=Path), default=Path(BENCH_DIR) / "pipeline.json",
                 help="JSON result (a plot beside it)"),
    click.Option(["--worker"], type=click.Path(path_type=Path), hidden=True),  # one rank's process (internal)
]


def check(args: Namespace) -> str | None:
    """What no single option's type rules out."""
    if args.worker is None and args.nproc < 2:
        return f"--nproc: a pipeline needs at least 2 stages, got {args.nproc}"
    return None


def main(args: Namespace) -> None:
    """Start the ranks (or be one), then summarize, plot and write the JSON."""
    if args.worker is not None:
        worker(args.worker, args.repeat, args.schedule)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = torchrun_argv(args.nproc, [__file__, "--worker", str(raw_path), "--repeat", str(args.repeat),
                                         "--schedule", args.schedule])
        proc = run_child(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench pipeline: the ranks failed: {proc.stderr.strip().splitlines()[-1:]}")
        result = summarize(json.loads(raw_path.read_text()))
    publish_result(result, args.out, plot)
    for row in result["rows"]:
        print(f"M={row['microbatches']}: idle {row['idle_measured']:.2f} (model {row['idle_model']:.2f}), "
              f"communication {row['comm_fraction']:.2f} of the step, idle minus it {row['idle_minus_comm']:.2f}")


COMMAND = Benchmark("pipeline", __doc__, OPTIONS, main, check)

if __name__ == "__main__":
    COMMAND.script()

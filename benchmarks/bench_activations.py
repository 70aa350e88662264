"""Activation memory and its price: sequence parallelism against tensor parallelism, and recomputation.

Starts ``--nproc`` ranks with torchrun and builds the causal transformer under each contender through the
layouts themselves (``build_layout`` → ``wrap`` → ``forward_backward``):

* ``tp`` and ``tp_sp`` (tensor parallel over all ranks, without and with Megatron sequence parallelism);
* ``ddp`` and ``ddp + recompute``, ``tp_sp + recompute`` (``parallel.recompute``: every block checkpointed).

Per contender and rank: bytes by category (parameters, gradients, optimizer state, activations saved for
backward, measured from the tensors: ``worldpipe.parallel.memory``) and the median seconds of a training step
(forward, backward, AdamW), the contenders interleaved round by round so that load drifts hit them alike. Ratios
against the same-run baselines: tp_sp/tp activations, recompute/no-recompute activations and step time.
JSON to ``--out``; ``activations.png`` beside it.
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

SIZES = {"width": 128, "heads": 4, "layers": 4, "mlp_ratio": 4}
BATCH, WINDOW = 8, 64
# contender -> layout config (tensor-parallel degree filled in with the world size)
CONTENDERS = {
    "tp": {"strategy": "none", "tensor_parallel": None},
    "tp_sp": {"strategy": "none", "tensor_parallel": None, "sequence_parallel": True},
    "tp_sp + recompute": {"strategy": "none", "tensor_parallel": None, "sequence_parallel": True, "recompute": True},
    "ddp": {"strategy": "ddp"},
    "ddp + recompute": {"strategy": "ddp", "recompute": True},
}


def _setup(runtime, spec: dict):
    from worldpipe.models.transformer import CausalTransformer
    from worldpipe.parallel.layout import build_layout

    cfg = {k: (runtime.world_size if v is None else v) for k, v in spec.items()}
    torch.manual_seed(0)
    core = CausalTransformer(3, 1, **SIZES)
    layout = build_layout(cfg, runtime)
    model = layout.wrap(core)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **layout.optimizer_kwargs)
    gen = torch.Generator().manual_seed(1)
    rows = BATCH // layout.dp_size
    batch = {"obs": torch.randn(rows, WINDOW, 3, generator=gen), "action": torch.randn(rows, WINDOW, 1, generator=gen),
             "reward": torch.randn(rows, WINDOW, generator=gen), "mask": torch.ones(rows, WINDOW), "noise": None}
    return core, layout, model, optimizer, batch


def _step(core, layout, model, optimizer, batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    layout.forward_backward(model, batch, BATCH * WINDOW, core.loss_terms)
    optimizer.step()
    return time.perf_counter() - start


def worker(out: Path, rounds: int) -> None:
    """Every rank: memory of each contender, then interleaved timed steps; rank 0 writes the raw rows."""
    die_with_parent()  # torchrun starts each rank in a session of its own: the rank goes when torchrun does
    from worldpipe.parallel.memory import saved_activations, state_bytes
    from worldpipe.parallel.runtime import init_runtime

    torch.set_num_threads(1)
    runtime = init_runtime()
    built, memory = {}, {}
    for name, spec in CONTENDERS.items():
        core, layout, model, optimizer, batch = built[name] = _setup(runtime, spec)
        with saved_activations(model) as held:
            optimizer.zero_grad(set_to_none=True)
            layout.forward_backward(model, batch, BATCH * WINDOW, core.loss_terms)
        optimizer.step()
        memory[name] = {**state_bytes(model, optimizer), "activations": sum(held.values())}
    times = {name: [] for name in CONTENDERS}
    for _ in range(rounds):
        for name in CONTENDERS:
            times[name].append(_step(*built[name]))
    mine = {"rank": runtime.rank, "memory": memory, "step_s": {k: statistics.median(v) for k, v in times.items()}}
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine)
    if runtime.is_main:
        out.write_text(json.dumps({"world_size": runtime.world_size, "backend": dist.get_backend(),
                                   "model": SIZES, "batch": BATCH, "window": WINDOW, "ranks": gathered}))
    dist.destroy_process_group()


def summarize(raw: dict) -> dict:
    """Per contender: the largest rank's bytes per category and the slowest rank's step; the ratios."""
    ranks = raw["ranks"]
    contenders = {}
    for name in CONTENDERS:
        memory = {cat: max(r["memory"][name][cat] for r in ranks) for cat in ranks[0]["memory"][name]}
        contenders[name] = {"memory": memory, "step_s": max(r["step_s"][name] for r in ranks)}
    c = contenders
    raw["contenders"] = c
    raw["ratios"] = {
        "tp_sp_over_tp_activations": c["tp_sp"]["memory"]["activations"] / c["tp"]["memory"]["activations"],
        "recompute_over_ddp_activations": c["ddp + recompute"]["memory"]["activations"] / c["ddp"]["memory"]["activations"],
        "recompute_over_ddp_step_time": c["ddp + recompute"]["step_s"] / c["ddp"]["step_s"],
        "tp_sp_recompute_over_tp_sp_activations": (c["tp_sp + recompute"]["memory"]["activations"]
                                                   / c["tp_sp"]["memory"]["activations"]),
        "tp_sp_recompute_over_tp_sp_step_time": c["tp_sp + recompute"]["step_s"] / c["tp_sp"]["step_s"],
        "tp_sp_over_tp_step_time": c["tp_sp"]["step_s"] / c["tp"]["step_s"],
    }
    return raw


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["contenders"])
    cats = ("parameters", "gradients", "optimizer_state", "activations")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(names)
    for cat in cats:
        values = [result["contenders"][n]["memory"][cat] / 2**20 for n in names]
        left.bar(names, values, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set(ylabel="MiB per rank (largest rank)", title=f"Memory by category, {result['world_size']} ranks")
    left.tick_params(axis="x", labelrotation=20, labelsize=8)
    left.legend(fontsize=8)
    right.bar(names, [result["contenders"][n]["step_s"] * 1e3 for n in names], color="gray")
    right.set(ylabel="ms per training step (median, slowest rank)", title="Step time (interleaved rounds)")
    right.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


OPTIONS = [
    click.Option(["--nproc"], type=int, default=2, help="ranks (the tensor-parallel degree; divides 4 heads)"),
    click.Option(["--rounds"], type=int, default=5, help="interleaved timed steps per contender (median)"),
    click.Option(["--out"], type=click.Path(path_type=Path), default=Path(BENCH_DIR) / "activations.json",
                 help="JSON result (a plot beside it)"),
    click.Option(["--worker"], type=click.Path(path_type=Path), hidden=True),  # one rank's process (internal)
]


def check(args: Namespace) -> str | None:
    """What no single option's type rules out."""
    if args.worker is None and (args.nproc < 2 or SIZES["heads"] % args.nproc):
        return f"--nproc: {args.nproc} ranks must be >= 2 and divide the model's {SIZES['heads']} heads"
    return None


def main(args: Namespace) -> None:
    """Start the ranks (or be one), then summarize, plot and write the JSON."""
    if args.worker is not None:
        worker(args.worker, args.rounds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = torchrun_argv(args.nproc, [__file__, "--worker", str(raw_path), "--rounds", str(args.rounds)])
        proc = run_child(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench activations: the ranks failed: {proc.stderr.strip().splitlines()[-1:]}")
        result = summarize(json.loads(raw_path.read_text()))
    publish_result(result, args.out, plot)
    for name, c in result["contenders"].items():
        print(f"{name}: activations {c['memory']['activations'] / 2**20:.2f} MiB, step {c['step_s'] * 1e3:.1f} ms")
    print(json.dumps(result["ratios"], indent=2))


COMMAND = Benchmark("activations", __doc__, OPTIONS, main, check)

if __name__ == "__main__":
    COMMAND.script()

"""The layout planner against measurement: `worldpipe plan`'s predictions, then every layout it says fits trained
under real torchrun and measured.

For each world size of ``--nproc``: runs ``worldpipe plan experiment=E world_size=N --json`` (the command a user
runs), then starts N gloo ranks with torchrun that train the experiment's model (built from its composed config,
the same batch and window) for a warm-up step and one counted step under each layout the plan ranks as fitting
(``worldpipe.parallel.measured_step``: the trainer's step through the layout itself). Measured per layout: the
largest rank's bytes by category (parameters, gradients, AdamW state, activations autograd saves) and rank 0's
bytes and calls of every collective (``worldpipe.parallel.collectives``). ``model.layers=2`` by default, so
that the pipeline layouts (pp, dp_pp) have two blocks to cut between.

Writes JSON to ``--out`` (per world size and layout: predicted and measured memory, their ratio, and the
collectives, predicted and measured), ``plan.png`` (measured / predicted per category) and the table beside it
as ``plan.csv`` and ``plan.html``.
"""

from __future__ import annotations

import csv
import html
import io
import json
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import click

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.atomic import write_text_atomic
from worldpipe.core.children import die_with_parent, run_child
from worldpipe.core.figures import save_figure
from worldpipe.launch.torchrun import torchrun_argv
from worldpipe.measure.publish import publish_result

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
ENV = "Pendulum-v1"  # `worldpipe plan`'s default environment: it sizes the model's inputs


def predict(experiment: str, world_size: int, overrides: list[str]) -> list[dict]:
    """`worldpipe plan ... --json`, as a user runs it."""
    argv = [sys.executable, "-m", "worldpipe.cli", "plan", f"experiment={experiment}", f"world_size={world_size}",
            "--json", "--env", ENV, *overrides]
    proc = run_child(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench plan: worldpipe plan failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def run_spec(experiment: str, overrides: list[str]) -> dict:
    """What every rank needs to build the model and its batch: the composed config's model, sizes and clip."""
    from omegaconf import OmegaConf

    from worldpipe.config.compose import compose_config
    from worldpipe.data.environments import env_dims

    cfg = compose_config([f"experiment={experiment}", *overrides])
    dims = env_dims(ENV)
    return {"model": OmegaConf.to_container(cfg.model, resolve=True), "obs_dim": dims.obs_dim,
            "act_dim": dims.act_dim, "batch": int(cfg.trainer.batch_size), "window": int(cfg.data.window),
            "grad_clip": float(cfg.trainer.grad_clip)}


def worker(spec_path: Path, out: Path) -> None:
    """Every rank: measure each layout of the spec in turn; rank 0 writes them."""
    die_with_parent()  # torchrun starts each rank in a session of its own: the rank goes when torchrun does
    import torch

    from worldpipe.models import build_model
    from worldpipe.parallel.measured_step import measure_layout, synthetic_batch
    from worldpipe.parallel.runtime import init_runtime, shutdown_runtime

    spec = json.loads(spec_path.read_text())
    runtime = init_runtime("gloo")
    batch = synthetic_batch(spec["batch"], spec["window"], spec["obs_dim"], spec["act_dim"])
    measured = {}
    for name, parallel in spec["layouts"].items():
        torch.manual_seed(0)
        model = build_model(spec["model"], spec["obs_dim"], spec["act_dim"])
        measured[name] = measure_layout(model, parallel, runtime, batch, spec["grad_clip"])
    if runtime.rank == 0:
        out.write_text(json.dumps(measured))
    shutdown_runtime()


def measure(world_size: int, spec: dict, layouts: dict[str, dict]) -> dict:
    """Train every layout under torchrun on ``world_size`` ranks; the measurement of each."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, raw_path = Path(tmp) / "spec.json", Path(tmp) / "measured.json"
        spec_path.write_text(json.dumps({**spec, "layouts": layouts}))
        cmd = torchrun_argv(world_size, [__file__, "--worker", str(spec_path), "--out", str(raw_path)])
        proc = run_child(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench plan: the ranks failed: {proc.stderr.strip().splitlines()[-1:]}")
        return json.loads(raw_path.read_text())


def compare(predicted: dict, measured: dict) -> dict:
    """One layout's row: memory predicted, measured (largest rank) and their ratio; collectives of both."""
    from worldpipe.parallel.measured_step import largest_rank_memory

    memory = largest_rank_memory(measured)
    comm = measured["ranks"][0]["comm"]
    return {"memory_predicted": {c: predicted["memory_bytes"][c] for c in CATEGORIES},
            "memory_measured": {c: memory[c] for c in CATEGORIES},
            "memory_ratio": {c: memory[c] / predicted["memory_bytes"][c] if predicted["memory_bytes"][c] else None
                             for c in CATEGORIES},
            "comm_predicted": predicted["comm"], "comm_measured": comm,
            "comm_exact": {k: comm.get(k) == v for k, v in predicted["comm"].items()},
            "comm_unpredicted": sorted(set(comm) - set(predicted["comm"])), "degrees": predicted["degrees"]}


def _selected(name: str, world_size: int, only: set[str] | None) -> bool:
    """Whether ``--layouts`` asks for this layout on this world size (NAME: on every one, NAME@N: on N)."""
    return only is None or name in only or f"{name}@{world_size}" in only


def run(world_sizes: list[int], experiment: str, overrides: list[str], only: set[str] | None = None) -> dict:
    """Predict and measure every fitting layout on every world size (of those in ``only``, when given)."""
    from worldpipe.commands.plan import layouts_from_conf

    spec = run_spec(experiment, overrides)
    conf = layouts_from_conf(recompute=True)
    result = {"experiment": experiment, "overrides": overrides, "env": ENV, "backend": "gloo", "spec": spec,
              "world_sizes": {}}
    for n in world_sizes:
        predictions = predict(experiment, n, overrides)
        fits = {p["layout"]: p for p in predictions if p["fits"] and _selected(p["layout"], n, only)}
        measured = measure(n, spec, {name: conf[name] for name in fits})
        result["world_sizes"][str(n)] = {
            "layouts": {name: compare(fits[name], measured[name]) for name in fits},
            "ruled_out": {p["layout"]: p["reason"] for p in predictions if not p["fits"]}}
    return result


def _comm_text(comm: dict) -> str:
    return "; ".join(f"{k} {v['bytes']} × {v['rounds']}" for k, v in sorted(comm.items())) or "none"


def table_rows(result: dict) -> list[dict[str, str]]:
    """The predicted-vs-measured table, one row per world size and layout (bytes per rank)."""
    rows = []
    for n, ws in result["world_sizes"].items():
        for name, row in ws["layouts"].items():
            out = {"world size": n, "layout": name}
            for c in CATEGORIES:
                out[f"{c} pred / meas"] = f"{row['memory_predicted'][c]} / {row['memory_measured'][c]}"
            out["collectives predicted (bytes × calls)"] = _comm_text(row["comm_predicted"])
            out["collectives measured (bytes × calls)"] = _comm_text(row["comm_measured"])
            out["bytes exact"] = "yes" if all(row["comm_exact"].values()) else "no"
            rows.append(out)
    return rows


def write_tables(result: dict, out: Path) -> None:
    """``plan.csv`` and ``plan.html`` beside the JSON (the HTML is the report's table)."""
    rows = table_rows(result)
    head = list(rows[0]) if rows else ["world size", "layout"]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=head)
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out.with_suffix(".csv"), text.getvalue())
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(r[h])}</td>" for h in head) + "</tr>\n" for r in rows)
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>worldpipe plan vs measured</title>"
            "<style>td,th{border:1px solid #ccc;padding:3px 6px;font:12px sans-serif}table{border-collapse:"
            "collapse}</style></head><body>"
            f"<p>{html.escape(result['experiment'])} {html.escape(' '.join(result['overrides']))}, "
            f"{result['backend']} ranks; bytes per rank (memory: the largest rank; collectives: rank 0, one step)</p>"
            "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>\n" + cells
            + "</table></body></html>\n")
    write_text_atomic(out.with_suffix(".html"), page)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios = [], {c: [] for c in CATEGORIES}
    for n, ws in result["world_sizes"].items():
        for name, row in ws["layouts"].items():
            labels.append(f"{name} ({n})")
            for c in CATEGORIES:
                ratios[c].append(row["memory_ratio"][c] or 0.0)
    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(labels)), 4))
    width = 0.8 / len(CATEGORIES)
    for i, c in enumerate(CATEGORIES):
        ax.bar([x + i * width for x in range(len(labels))], ratios[c], width, label=c)
    ax.axhspan(0.85, 1.15, color="green", alpha=0.1, label="within 15%")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=45, ha="right", fontsize=8)
    ax.set(ylabel="measured / predicted (largest rank)",
           title=f"worldpipe plan vs measured: {result['experiment']}, layout (world size)")
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


OPTIONS = [
    click.Option(["--nproc"], default="2,4", help="world sizes, comma-separated"),
    click.Option(["--experiment"], default="smoke_transformer", help="experiment whose model is planned and trained"),
    click.Option(["--overrides"], default="model.layers=2", help="Hydra overrides, space-separated"),
    click.Option(["--layouts"], default="", show_default="every one that fits",
                 help="measure only these layouts, comma-separated; NAME@N: only on N ranks"),
    click.Option(["--out"], type=click.Path(path_type=Path), default=Path(BENCH_DIR) / "plan.json",
                 help="JSON result (plot and tables beside it)"),
    click.Option(["--worker"], type=click.Path(path_type=Path), hidden=True),  # the ranks' process (internal)
]


def parse_args(argv: list[str] | None = None) -> Namespace:
    """The benchmark's options (the pipeline config's ``bench.plan`` keys, dashed)."""
    return COMMAND.parse(argv)


def main(args: Namespace) -> None:
    """Plan, then measure every layout that fits (or be the ranks' process)."""
    if args.worker is not None:
        worker(args.worker, args.out)
        return
    try:
        world_sizes = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        raise SystemExit(f"--nproc: expected world sizes like 2,4, got {args.nproc!r}") from None
    only = set(args.layouts.split(",")) if args.layouts else None
    result = run(world_sizes, args.experiment, args.overrides.split(), only)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_tables(result, args.out)
    publish_result(result, args.out, plot)
    for row in table_rows(result):
        print(" | ".join(row.values()))


COMMAND = Benchmark("plan", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

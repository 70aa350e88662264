"""Start-up: time from `worldpipe train` to the end of the first training step, broken down by part.

Every process on the way writes named timestamps (``WORLDPIPE_STARTUP_TRACE``, see worldpipe.measure.startup):
the launcher (config composition, validation, resume preflight), torchrun's worker (imports, Hydra, process
group), the trainer (dataset verification, model, resume, MLflow run start, first step). Contenders, in the
same run, each started as a fresh process on a fresh run directory of the tiny smoke config, one rank:

* ``torchrun``  — the launcher spawns torchrun, which spawns the worker (``WORLDPIPE_LAUNCHER=torchrun``);
* ``in-process`` — a single-process run trains inside the launcher (the default), the MLflow run started by the
  tracking courier while the first steps run (the synchronous start it replaced is retired; its figures, measured
  by this benchmark at 28d38ef, are in docs/benchmarks.md);
* ``in-process, resume`` — the same as ``in-process``, resuming from a one-step checkpoint (trained once, untimed,
  and copied for every round);
* ``in-process, tracking off`` — no MLflow run (``tracking.enabled=false``);
* ``bare script`` (baseline) — python imports torch and the model, builds model + AdamW, takes one step on a
  random batch of the same shape. Target: in-process <= 2 s over the bare script.

Contenders run in rounds whose order changes (:mod:`worldpipe.measure.contender_order`); each is summarized by the median
over rounds. The MLflow run start is an event after the first step (``mlflow_run_opened``): reported, not part
of the critical path.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import click

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.children import run_child
from worldpipe.core.figures import save_figure
from worldpipe.data.build import build_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.launch.local_run import LAUNCHER_ENV
from worldpipe.measure.contender_order import median_of_means, run_rounds
from worldpipe.measure.publish import publish_result
from worldpipe.measure.startup import TRACE_ENV

TARGET_OVERHEAD_S = 2.0
BARE_SCRIPT = """
import torch
from worldpipe.measure.startup import mark
from worldpipe.models import build_model
torch.manual_seed(0)
torch.set_num_threads(1)
model = build_model({"_target_": "worldpipe.models.rssm.RSSM", "embed": 16, "deter": 16, "stoch": 4,
                     "hidden": 32}, 3, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
obs, act = torch.randn(8, 16, 3), torch.randn(8, 16, 1)
sums = model(obs, act, torch.randn(8, 16), torch.ones(8, 16), torch.randn(8, 16, 4))
sums["total"].backward()
opt.step()
mark("first_step_done")
"""
# Events of the tracking courier: when they happened is reported; they end no span of the critical path.
BACKGROUND_EVENTS = ("mlflow_run_opened",)
CONTENDER = "in-process"
# What each span (ending at the named event) covers.
SPANS = {
    "launcher_start": "interpreter + CLI imports",
    "config_composed": "config composition",
    "preflight_done": "validation, data check, run lock, resume preflight",
    "torchrun_spawned": "launcher bookkeeping",
    "torchrun_main": "torchrun start (a fresh interpreter: imports torch)",
    "worker_process_start": "rendezvous + worker interpreter spawn",
    "train_imported": "training imports",
    "train_start": "worker config composition (hydra.main)",
    "process_group_ready": "process group / rendezvous",
    "dataset_verified": "dataset verification (manifest, store open, stats)",
    "model_built": "model + optimizer build",
    "resumed": "checkpointer + resume",
    "mlflow_run_started": "MLflow records journaled (the run itself is started by the courier)",
    "first_step_done": "first training step",
}


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/startup.json", help="JSON result (a plot beside it)"),
    click.Option(["--repeats"], type=int, default=3, help="runs per contender (median reported)"),
]


def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


def read_trace(path: Path, t0: float) -> dict[str, float]:
    """Seconds after ``t0`` of each event (first occurrence), plus the worker's process start under torchrun."""
    events: dict[str, float] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        events.setdefault(rec["event"], rec["t"] - t0)
        if rec["event"] == "train_imported" and "torchrun_spawned" in events and rec["process_start"]:
            events.setdefault("worker_process_start", rec["process_start"] - t0)
    return events


def breakdown(events: dict[str, float]) -> dict[str, float]:
    """Span name -> seconds, in the order the events happened (spans end at their event)."""
    if list(events) == ["first_step_done"]:
        return {"bare script: interpreter, imports, model build, one step": events["first_step_done"]}
    out, previous = {}, 0.0
    end = events["first_step_done"]
    on_path = ((e, t) for e, t in events.items() if t <= end and e not in BACKGROUND_EVENTS)
    for event, at in sorted(on_path, key=lambda kv: kv[1]):
        out[SPANS.get(event, event)] = at - previous
        previous = at
    return out


def timed_run(cmd: list[str], env: dict, trace: Path) -> dict[str, float]:
    trace.unlink(missing_ok=True)
    t0 = time.time()
    proc = run_child(cmd, env={**env, TRACE_ENV: str(trace)}, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return read_trace(trace, t0)


def contenders(work: Path, store: Path, manifest: Path, env: dict) -> Callable[[int], dict]:
    """Contender name -> (command, extra environment), for a given round (fresh run directories each round)."""
    train = [sys.executable, "-m", "worldpipe.cli", "train", "experiment=smoke", "parallel=single",
             f"data.store={store}", f"data.manifest={manifest}", "trainer.progress_bar=false",
             f"tracking.uri=sqlite:///{work}/mlflow.db"]
    bare = work / "bare.py"
    bare.write_text(BARE_SCRIPT)
    seed = work / "resume-seed"  # one step and its checkpoint, trained once outside the timings
    proc = run_child([*train, "trainer.steps=1", "checkpoint.every=1", f"run_dir={seed}"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the run to resume from failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def for_round(i: int) -> dict:
        resumed = work / f"resume-{i}"
        if not resumed.exists():
            shutil.copytree(seed, resumed)
        return {
            "bare script": ([sys.executable, str(bare)], {}),
            "torchrun": ([*train, "trainer.steps=1", f"run_dir={work}/torchrun-{i}"], {LAUNCHER_ENV: "torchrun"}),
            CONTENDER: ([*train, "trainer.steps=1", f"run_dir={work}/inproc-{i}"], {}),
            "in-process, resume": ([*train, "trainer.steps=2", f"run_dir={resumed}"], {}),
            "in-process, tracking off": ([*train, "trainer.steps=1", "tracking.enabled=false",
                                          f"run_dir={work}/untracked-{i}"], {}),
        }

    return for_round


def main(args: Namespace) -> int:
    env = {k: v for k, v in os.environ.items()
           if k not in (TRACE_ENV, LAUNCHER_ENV, "MLFLOW_TRACKING_URI")}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        spec = DatasetSpec(name="startup", env_id="Pendulum-v1", policy="noisy_controller", episodes=16,
                           max_steps=64, episodes_per_shard=4, seed=0)
        build_dataset(str(work / "store.zarr"), spec, manifest_path=str(work / "manifest.json"))
        # Create and migrate the MLflow store once, outside the timings: a run starts against an existing store.
        import mlflow

        mlflow.MlflowClient(f"sqlite:///{work}/mlflow.db").search_experiments()
        runs = contenders(work, work / "store.zarr", work / "manifest.json", env)

        def measure(name: str, spec: tuple, i: int) -> dict[str, float]:
            cmd, extra = spec
            events = timed_run(cmd, {**env, **extra}, work / "trace.jsonl")
            print(f"{name:28s} run {i}: first step after {events['first_step_done']:.2f} s")
            return events

        results = run_rounds(args.repeats, runs, measure)
    report = summarize(results, args.repeats)
    publish_result(report, args.out, plot)
    return 0


def summarize(results: dict[str, list[dict]], repeats: int) -> dict:
    bare = median_of_means(r["first_step_done"] for r in results["bare script"])
    report = {"benchmark": "startup", "repeats": repeats, "target_overhead_s": TARGET_OVERHEAD_S,
              "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
                          "python": platform.python_version()},
              "bare_script_s": bare, "contenders": {}}
    for name, runs in results.items():
        total = median_of_means(r["first_step_done"] for r in runs)
        median_run = min(runs, key=lambda r: abs(r["first_step_done"] - total))
        courier_events = {e: median_run[e] for e in BACKGROUND_EVENTS if e in median_run}
        report["contenders"][name] = {"first_step_s": total, "overhead_vs_bare_s": total - bare,
                                      "breakdown_s": breakdown(median_run), "courier_events_s": courier_events,
                                      "mlflow_on_critical_path_s": mlflow_span(runs),
                                      "all_runs_s": [r["first_step_done"] for r in runs], "all_runs_events_s": runs}
        print(f"{name:28s} {total:6.2f} s to first step, {total - bare:+6.2f} s vs bare script")
        for span, seconds in report["contenders"][name]["breakdown_s"].items():
            print(f"    {seconds:6.2f} s  {span}")
        for event, at in courier_events.items():
            where = "before" if at <= median_run["first_step_done"] else "after"
            print(f"    ({event} at {at:.2f} s, {where} the first step)")
    verdicts(report)
    return report


def mlflow_span(runs: list[dict]) -> float | None:
    """Median over runs of the trainer's time from resume to its MLflow records journaled: what tracking puts on
    the critical path, read per run (on a loaded machine far steadier than the difference of two totals)."""
    spans = [r["mlflow_run_started"] - r["resumed"] for r in runs if "mlflow_run_started" in r and "resumed" in r]
    return median_of_means(spans) if spans else None


def verdicts(report: dict) -> None:
    """Target met or not, torchrun against in-process, what tracking puts on the critical path."""
    c = report["contenders"]
    inproc = c[CONTENDER]["overhead_vs_bare_s"]
    report["in_process_meets_target"] = inproc <= TARGET_OVERHEAD_S
    report["torchrun_to_in_process_ratio"] = c["torchrun"]["first_step_s"] / c[CONTENDER]["first_step_s"]
    report["tracking_on_critical_path_s"] = c[CONTENDER]["mlflow_on_critical_path_s"]
    report["tracking_off_saves_s"] = c[CONTENDER]["first_step_s"] - c["in-process, tracking off"]["first_step_s"]
    print(f"in-process overhead {inproc:.2f} s (target <= {TARGET_OVERHEAD_S} s): "
          f"{'met' if report['in_process_meets_target'] else 'NOT met'}; torchrun/in-process "
          f"{report['torchrun_to_in_process_ratio']:.2f}x; MLflow records on the critical path (median per run) "
          f"{report['tracking_on_critical_path_s']:.2f} s, tracking off {report['tracking_off_saves_s']:+.2f} s")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["contenders"])
    spans = list(dict.fromkeys(s for n in names for s in report["contenders"][n]["breakdown_s"]))
    fig, ax = plt.subplots(figsize=(10, 5))
    left = [0.0] * len(names)
    for span in spans:
        values = [report["contenders"][n]["breakdown_s"].get(span, 0.0) for n in names]
        ax.barh(names, values, left=left, label=span)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.axvline(report["bare_script_s"] + TARGET_OVERHEAD_S, color="k", ls="--", label="target: bare + 2 s")
    ax.set_xlabel("seconds from launch to the end of the first training step")
    ax.set_title("Start-up breakdown (timestamps written by the processes)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


COMMAND = Benchmark("startup", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

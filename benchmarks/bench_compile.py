"""When ``trainer.compile=true`` pays off: time to the first step cold and warm, and the step time it buys.

Three runs of ``worldpipe train`` on the same tiny dataset, one process, one thread, tracking off, each timed
from its launch to the end of its first step (``first_step_done`` in the ``WORLDPIPE_STARTUP_TRACE``) and per
step over steps 2..N-1:

* ``eager`` (baseline);
* ``compiled, cold``: ``trainer.compile=true`` with an empty compile cache (``paths.compile_cache``), what the
  first process on a machine pays;
* ``compiled, warm``: the same again, a new process on the now filled cache (a rerun, a resume, another rank).

Cold must precede warm, so the runs are not rotated; ``--rounds`` repeats the whole sequence with a fresh cache.
Break-even: the steps after which the compiled run has caught up with eager,
(first step compiled - first step eager) / (eager step - compiled step), cold and warm.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import click
import numpy as np

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.children import run_child
from worldpipe.core.figures import save_figure
from worldpipe.data.build import build_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.measure.publish import publish_result
from worldpipe.measure.startup import TRACE_ENV

CONTENDERS = ("eager", "compiled, cold", "compiled, warm")


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/compile.json", help="JSON result (a plot beside it)"),
    click.Option(["--experiment"], default="smoke", help="experiment trained by every run"),
    click.Option(["--steps"], type=int, default=200, help="steps per run (the step time is their mean)"),
    click.Option(["--rounds"], type=int, default=1, help="cold-then-warm sequences, each on a fresh cache"),
    click.Option(["--window"], type=int, default=None,
                 help="data.window of the runs (default: the experiment's); the compiled graph unrolls the "
                      "recurrence over it, so a short window compiles in a fraction of the time"),
]


def check(args: Namespace) -> str | None:
    """What no single option's type rules out."""
    if args.steps < 4 or args.rounds < 1 or (args.window is not None and args.window < 2):
        return "--steps must be >= 4, --rounds >= 1 and --window >= 2"
    return None


def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


def timed_run(cmd: list[str], env: dict, trace: Path) -> dict:
    """Seconds from launch to the end of the first step, and the mean step time over steps 2..N-1."""
    trace.unlink(missing_ok=True)
    launched = time.time()
    proc = run_child(cmd, env={**env, TRACE_ENV: str(trace)}, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench compile: {' '.join(cmd[3:6])} failed ({proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    first = next(e["t"] for e in events if e["event"] == "first_step_done")
    ends = np.array([e["t"] for e in events if e["event"] == "step_end"])
    return {"first_step_s": first - launched, "step_ms": 1e3 * float(np.diff(ends)[:-1].mean())}


def commands(work: Path, args, round_: int) -> dict[str, list[str]]:
    train = [sys.executable, "-m", "worldpipe.cli", "train", f"experiment={args.experiment}", "parallel=single",
             f"data.store={work}/store.zarr", f"data.manifest={work}/manifest.json", f"trainer.steps={args.steps}",
             "trainer.progress_bar=false", "tracking.enabled=false", f"checkpoint.every={args.steps}",
             f"paths.compile_cache={work}/cache-{round_}"]
    if args.window is not None:
        train.append(f"data.window={args.window}")
    return {name: [*train, f"run_dir={work}/{name.replace(', ', '-')}-{round_}",
                   f"trainer.compile={'false' if name == 'eager' else 'true'}"] for name in CONTENDERS}


def break_even(eager: dict, compiled: dict) -> float | None:
    """Steps until the compiled run has caught up with eager (None: its steps are not faster)."""
    gain_s = (eager["step_ms"] - compiled["step_ms"]) / 1e3
    return (compiled["first_step_s"] - eager["first_step_s"]) / gain_s if gain_s > 0 else None


def main(args: Namespace) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (TRACE_ENV, "TORCHINDUCTOR_CACHE_DIR")}
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        work = Path(tmp)
        spec = DatasetSpec(name="compile", env_id="Pendulum-v1", policy="noisy_controller", episodes=16,
                           max_steps=64, episodes_per_shard=8, seed=0)
        build_dataset(str(work / "store.zarr"), spec, manifest_path=str(work / "manifest.json"))
        for round_ in range(args.rounds):
            for name, cmd in commands(work, args, round_).items():
                runs[name].append(timed_run(cmd, env, work / "trace.jsonl"))
                print(f"round {round_}: {name:16s} first step {runs[name][-1]['first_step_s']:7.1f} s, "
                      f"{runs[name][-1]['step_ms']:6.2f} ms/step")
    summary = {name: {key: statistics.median(r[key] for r in rs) for key in ("first_step_s", "step_ms")}
               for name, rs in runs.items()}
    report = {"benchmark": "compile", "experiment": args.experiment, "steps": args.steps, "rounds": args.rounds,
              "window": args.window,
              "machine": {"cpus": os.cpu_count(), "load_average_before": list(load_before),
                          "load_average_after": list(os.getloadavg()), "python": platform.python_version()},
              "contenders": {name: {**summary[name], "runs": runs[name]} for name in CONTENDERS},
              "warm_over_cold_first_step": summary["compiled, warm"]["first_step_s"]
              / summary["compiled, cold"]["first_step_s"],
              "compiled_over_eager_step": summary["compiled, warm"]["step_ms"] / summary["eager"]["step_ms"],
              "break_even_steps": {kind: break_even(summary["eager"], summary[f"compiled, {kind}"])
                                   for kind in ("cold", "warm")}}
    print(f"first step: cold {summary['compiled, cold']['first_step_s']:.1f} s, warm "
          f"{summary['compiled, warm']['first_step_s']:.1f} s, eager {summary['eager']['first_step_s']:.1f} s; "
          f"compiled step {report['compiled_over_eager_step']:.2f}x eager; break-even after "
          + ", ".join(f"{k} {'never' if v is None else f'{v:.0f} steps'}" for k, v in report["break_even_steps"].items()))
    publish_result(report, args.out, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Time to the first step and time per step of each contender, side by side. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders = report["contenders"]
    names = list(contenders)
    fig, (first, step) = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax, key, unit in ((first, "first_step_s", "s"), (step, "step_ms", "ms")):
        values = [contenders[n][key] for n in names]
        ax.barh(names, values, color=["tab:blue", "tab:orange", "tab:green"][:len(names)])
        for i, value in enumerate(values):
            ax.text(value, i, f" {value:.1f} {unit}", va="center", fontsize=8)
        ax.set_xlim(0, max(values) * 1.35)
        ax.invert_yaxis()
    first.set(xlabel="seconds from launch to the end of the first step", title="first step: cold vs warm cache")
    even = ", ".join(f"{k} {'never' if v is None else f'{v:.0f}'}" for k, v in report["break_even_steps"].items())
    step.set(xlabel="ms per step (steps 2..N-1, mean)", title=f"step time\nbreak-even after steps: {even}")
    fig.suptitle(f"worldpipe bench compile: experiment {report['experiment']}, {report['steps']} steps per run",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


COMMAND = Benchmark("compile", __doc__, OPTIONS, main, check)

if __name__ == "__main__":
    COMMAND.script()

"""The portable mode's cost: an experiment's training step on the native code paths vs the portable ones.

The code paths are chosen once per process (MKL, ATen and oneDNN read their variables at their first kernel), so
each contender is a fresh worker process of this script, started with the numerics config's variables
(:func:`worldpipe.core.numerics.pinned_variables`) in its environment; ``native`` is the baseline. Contenders
run in rounds whose order alternates; each worker times ``--steps`` eager training steps (forward, backward,
the optimizer's step as the mode builds it) of
the experiment's model on one random batch of its shape after 5 warm-up steps, on ``--threads`` threads (one
rank's share); a contender's step time is the median over rounds of its per-round mean. The ratio
portable / native is the cost.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from argparse import Namespace
from pathlib import Path

import click

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core import numerics
from worldpipe.core.children import run_child
from worldpipe.core.figures import save_figure
from worldpipe.measure.publish import publish_result

BASELINE = "native"
MODES = (BASELINE, "portable")


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/numerics.json", help="JSON result (a plot beside it)"),
    click.Option(["--experiment"], default="pendulum_rssm", help="experiment whose model and batch shape are timed"),
    click.Option(["--env"], default="Pendulum-v1", help="environment of the experiment's data (observation sizes)"),
    click.Option(["--threads"], type=int, default=1, help="intra-op threads (one rank's share: 1)"),
    click.Option(["--rounds"], type=int, default=5, help="rounds of both contenders (median of round means)"),
    click.Option(["--steps"], type=int, default=30, help="timed steps per contender per round"),
    click.Option(["--worker"], type=click.Choice(MODES), hidden=True),  # one contender's process (internal)
]


def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


def mode_settings(mode: str) -> dict:
    """The numerics group of ``conf/numerics/<mode>.yaml`` as composed for the experiment."""
    from omegaconf import OmegaConf

    from worldpipe.launch.launcher import compose_config

    return OmegaConf.to_container(compose_config([f"numerics={mode}"]).numerics, resolve=True)


def worker(args) -> None:
    """Time the experiment's training step in this process (its code paths were fixed by its environment)."""
    import time

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import make_step, model_and_batch  # the same model and batch as `bench step`

    from worldpipe.trainer.optim import build_optimizer

    torch.set_num_threads(args.threads)
    _, model, batch = model_and_batch(args.experiment, args.env)
    optimizer = build_optimizer(model, {"lr": 1e-3, "weight_decay": 0.0}, mode_settings(args.worker)["fused_optimizer"])
    backward = make_step(model, batch)

    def step() -> None:
        backward()
        optimizer.step()

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(json.dumps({"step_s": (time.perf_counter() - start) / args.steps,
                      "environment": numerics.environment("cpu")}))


def run_worker(mode: str, args) -> dict:
    env = {**os.environ, **numerics.pinned_variables(mode_settings(mode))}
    if mode == BASELINE:  # the native paths: whatever the machine picks, not a leftover pin of the caller's shell
        for var in numerics.PIN_VARIABLES.values():
            env.pop(var, None)
    cmd = [sys.executable, __file__, "--worker", mode, "--experiment", args.experiment, "--env", args.env,
           "--threads", str(args.threads), "--steps", str(args.steps)]
    proc = run_child(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"bench numerics: the {mode} worker failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(report["contenders"])
    ax.bar(names, [report["contenders"][n]["step_ms"] for n in names], color=["#4c72b0", "#dd8452"])
    ax.set_ylabel("ms per training step (median of rounds)")
    ax.set_title(f"{report['experiment']}: portable / native = {report['ratio']:.3f}")
    save_figure(fig, path)
    plt.close(fig)


def main(args: Namespace) -> int:
    if args.worker:
        worker(args)
        return 0
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    environments = {}
    for round_ in range(args.rounds):
        for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
            result = run_worker(mode, args)
            samples[mode].append(result["step_s"])
            environments[mode] = result["environment"]
    contenders = {mode: {"step_ms": statistics.median(values) * 1e3, "round_ms": [v * 1e3 for v in values],
                         "environment": environments[mode]} for mode, values in samples.items()}
    ratio = contenders["portable"]["step_ms"] / contenders[BASELINE]["step_ms"]
    report = {"experiment": args.experiment, "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "baseline": BASELINE, "contenders": contenders, "ratio": ratio,
              "differing_fields": numerics.differences(environments[BASELINE], environments["portable"])}
    for mode, c in contenders.items():
        print(f"{mode:9s} {c['step_ms']:7.2f} ms/step  ({numerics.summary(c['environment'])})")
    print(f"portable / native = {ratio:.3f} ({args.experiment}, {args.threads} thread(s), median of {args.rounds} "
          f"rounds of {args.steps} steps)")
    publish_result(report, args.out, plot)
    return 0


COMMAND = Benchmark("numerics", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

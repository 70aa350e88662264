"""Training-loop overhead: the trainer's marginal time per step against a bare hand-written torch loop.

Same model (the config's), same data (the same store, global sampler and WindowLoader), same batch, same
noise, one process and one thread each, measured in one run. Per-step times come from a timestamp written at
the end of every step (``WORLDPIPE_STARTUP_TRACE``); the marginal time per step is the mean over steps 2..N-1
(start-up and the always-saved final checkpoint excluded; checkpoints at the cadence included), median over
rounds whose contender order changes, balanced over positions and neighbours (:mod:`worldpipe.measure.contender_order`).
A fixed cost must not read as a per-step one, so each contender is reported three ways: ``startup_s`` (from
launching the command to the end of its first step: imports, data, model, MLflow's run start), ``mean_ms``
(per step over steps 2..N-1) and ``steady_ms`` (per step over the second half of them, after the fixed costs
have settled: the marginal cost of one more step), each with its ratio to the bare loop's;
``paired_steady_ratio_vs_bare`` is the median over rounds of the contender's steady step over the bare loop's in
the same round (adjacent runs: the machine's drift between rounds cancels). ``targets`` checks the paired steady
ratios against #41's bars (trainer <= 1.03x, trainer + tracking <= 1.05x) and the run-level checkpoint overheads
against 3.5%, each with the median's distribution-free interval over the rounds and a verdict: met, not met, or
unresolved (the bar inside the interval). Contenders:

* ``bare loop`` (baseline) — next_batch, noise, forward, backward, clip, AdamW, LR schedule; nothing else;
* ``trainer``               — `worldpipe train`, tracking off, no checkpoint before the last step;
* ``trainer + tracking``    — MLflow (SQLite) records at the default log cadence;
* ``trainer + tracking + checkpoints`` — also checkpoints at the default cadence (conf/checkpoint).
* ``trainer + tracking + async checkpoints`` — the same with ``checkpoint.async_save=true``.
* the last two again with saves ``--amplify`` times as often (``..., saves 10x as often``; 0 leaves them out);
* ``trainer, compiled``     — ``trainer.compile=true`` (torch.compile of the loss), tracking off (when the
  trainer has that option).

Whole-run views, in the same run:

* ``run_level_checkpoint_overhead``: the run with checkpoints at the default cadence (``checkpoint.every``
  as conf/checkpoint ships it, 250) against the same run without them, time per step over the run
  (saves included) - 1. Target <= 0.035 (CheckFreq's bar). ``run_level_async_checkpoint_overhead``: the same
  for async saves. On a shared machine the runs of one contender differ by more than the target between rounds,
  so each is also given paired (``..._paired``: the median over rounds of that round's with/without - 1, the two
  runs adjacent in time) and from the trainer's own clock (``checkpoint_share_of_wall``: the loop's time inside
  checkpoint saves, less that of the run without cadence saves (both save the final step), over its wall time;
  a background writer's slowdown of later steps is not in it). Fixed and marginal apart, as for the step:
  ``..._steady`` is the same ratio over the second half (as many saves per step, no start-up);
  ``..._within_run`` compares no runs at all: within each run with cadence saves, the time of every save's step
  and the 39 steps after it, less as many steps at the mean of the steps outside those windows, over the steps
  between two saves (median over saves, then over rounds; ``within_run_control`` is the same figure for the run
  without cadence saves, the estimator's zero); and each
  contender's ``first_save_extra_s`` is how much longer its first cadence save took than a later one (the
  first checkpoint names the MLflow run, so it waits for the run start if that is still in flight).
* ``..._amplified``: the whole-run comparison with the signal made larger than the noise. At the default cadence
  a run's saves cost ~3% of it, and runs of one contender differ by 2-4% from round to round, so ten paired
  rounds leave an interval several points wide. The runs that save ``--amplify`` (10) times as often pay ten
  times the cost under the same noise; their paired overhead, scaled back to one save per default cadence
  (``x (timed steps) / (their timed saves x cadence)``), is a whole-run figure (the writer thread, the records'
  delivery, cold caches: all of it) whose interval is ten times narrower. It assumes each save costs the same
  however close the next one is; saves ten times as dense share caches and the writer's time less kindly, so
  if anything it reads high. ``..._within_run`` at the default cadence is the check on it.
* ``wall_split`` per trainer contender: where the training loop's wall time went (the trainer's own part
  clock, all steps): ``compute`` (forward, backward, optimizer; under DDP this includes the gradient
  all-reduce it overlaps), ``waiting_io`` (the next batch, checkpoint saves, tracking records),
  ``waiting_ranks`` (the per-step collective that agrees on preemption: time waiting for the slowest rank),
  ``other``; and ``cpu_over_wall``, the process's CPU time (all threads) over the loop's wall time.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.children import run_child
from worldpipe.core.figures import save_figure
from worldpipe.data.build import build_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.measure.contender_order import median_interval, median_of_means, run_rounds
from worldpipe.measure.publish import publish_result
from worldpipe.measure.startup import TRACE_ENV

BARE_LOOP = """
import sys, torch
from worldpipe.config.compose import compose_config
from worldpipe.data.loader import WindowLoader
from worldpipe.data.manifest import load_manifest
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.store import TrajectoryStore
from worldpipe.measure.startup import mark
from worldpipe.models import build_model
from worldpipe.models.noise import sample_noise
from worldpipe.trainer.optim import build_optimizer, build_scheduler

cfg = compose_config(sys.argv[1:])
torch.manual_seed(cfg.seed)
torch.set_num_threads(cfg.trainer.threads_per_rank)
torch.use_deterministic_algorithms(cfg.trainer.deterministic)
store = TrajectoryStore.open(cfg.data.store, manifest=load_manifest(cfg.data.manifest))
stats = store.obs_stats()
sampler = GlobalWindowSampler(store.lengths, cfg.data.window, cfg.data.stride, cfg.trainer.batch_size, cfg.seed)
loader = WindowLoader(store, sampler, 0, 1, obs_stats=stats, cache_bytes=cfg.data.cache_mb << 20,
                      prefetch=cfg.data.prefetch)
model = build_model(cfg.model, store.obs_dim, store.act_dim)
model.set_normalization(stats["obs_mean"], stats["obs_std"])
optimizer, generator = build_optimizer(model, cfg.trainer), torch.Generator()
scheduler = build_scheduler(optimizer, cfg.trainer)
for step in range(cfg.trainer.steps):
    batch = loader.next_batch()
    noise = sample_noise(cfg.seed, batch["sample_index"], model.noise_shape(batch["obs"].shape[1]), generator)
    sums = model(batch["obs"], batch["action"], batch["reward"], batch["mask"], noise)
    optimizer.zero_grad(set_to_none=True)
    (sums["total"] / batch["global_valid"]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
    optimizer.step()
    scheduler.step()
    mark("step_end")
loader.close()
"""


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/loop.json", help="JSON result (a plot beside it)"),
    click.Option(["--steps"], type=int, default=500, help="steps per contender (default cadences: log 10, ckpt 250)"),
    click.Option(["--experiment"], default="smoke", help="experiment every contender trains"),
    click.Option(["--no-compile"], is_flag=True, help="skip the compiled contender (its compile takes minutes)"),
    click.Option(["--rounds"], type=int, default=3, help="runs per contender; the median of their means is reported"),
    click.Option(["--amplify"], type=int, default=10, show_default=True,
                 help="also run the checkpoint contenders saving this many times as often (0: not)"),
]


def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


TARGET_RUN_LEVEL_OVERHEAD = 0.035
SAVE_WINDOW = 40  # steps from a save's on that it may still slow (a step after a save is slower for ~20)
TARGET_STEADY_RATIO = {"trainer": 1.03, "trainer + tracking": 1.05}
WITH_CHECKPOINTS, WITHOUT_CHECKPOINTS = "trainer + tracking + checkpoints", "trainer + tracking"
WITH_ASYNC_CHECKPOINTS = "trainer + tracking + async checkpoints"
CHECKPOINT_KINDS = (("sync", WITH_CHECKPOINTS, "run_level_checkpoint_overhead"),
                    ("async", WITH_ASYNC_CHECKPOINTS, "run_level_async_checkpoint_overhead"))


def amplified(name: str, factor: int) -> str:
    """The name of ``name``'s contender that saves ``factor`` times as often."""
    return f"{name}, saves {factor}x as often"


def amplified_cadence(cadence: int, factor: int) -> int | None:
    """The amplified contenders' ``checkpoint.every``; None when there are none (``factor`` 0 or 1)."""
    return max(1, cadence // factor) if factor > 1 else None


def saves_timed(steps: int, cadence: int) -> int:
    """Cadence saves among the timed steps 2..steps-1 (the final save is not timed)."""
    return (steps - 1) // cadence - (1 if cadence == 1 else 0)


@dataclass
class Sample:
    """One run of a contender: seconds per step (steps 2..N-1), the trainer's part clock (None: bare loop), and
    the start-up: seconds from the command's launch to the end of its first step."""

    times: np.ndarray
    parts: dict | None
    startup_s: float = float("nan")

    @property
    def steady(self) -> np.ndarray:
        """The second half of the timed steps: after the fixed costs (imports, MLflow's run start, the first
        samples of the system metrics) have settled; cadence checkpoints in it stay in it."""
        return self.times[len(self.times) // 2:]

    def save_excess_share(self, cadence: int, window: int = SAVE_WINDOW) -> float:
        """Within one run: what each cadence save adds, as a share of the steps between two saves.

        Each save's excess is the time of its step and the ``window - 1`` steps after it (a background writer,
        the records' delivery, cold caches) less as many steps at the mean of the steps outside every such window;
        the median excess over saves, over ``cadence`` such steps. Both terms come from the same process, so the
        drift between runs (±2-3% on a 2-core machine) is not in it. NaN without a cadence save with a whole
        window among the timed steps."""
        saves = [s - 2 for s in range(cadence, len(self.times) + 2, cadence)]
        starts = [start for start in saves if start + window <= len(self.times)]
        if not starts:
            return float("nan")
        inside = np.zeros(len(self.times), dtype=bool)
        for start in saves:  # a save near the end, without a whole window, is still no step "outside"
            inside[start:start + window] = True
        if inside.all():
            return float("nan")
        step = float(self.times[~inside].mean())
        excess = [float(self.times[start:start + window].sum()) - window * step for start in starts]
        return float(np.median(excess)) / (cadence * step)

    def first_save_extra_s(self, cadence: int) -> float:
        """How much longer the step of the first cadence save took than that of a later one (the median): the
        fixed part of saving, above all the first checkpoint's wait for the MLflow run start, which names the
        run. NaN without two cadence saves among the timed steps."""
        saves = self.times[cadence - 2::cadence]  # times[i] ends step i + 2; a save ends its step
        return float(saves[0] - np.median(saves[1:])) if len(saves) >= 2 else float("nan")


def read_trace(trace: Path, launched: float = float("nan")) -> Sample:
    """Seconds between consecutive step ends, steps 2..N-1 (first step and final checkpoint excluded), the
    trainer's ``loop_parts`` summary when it wrote one, and the start-up from ``launched`` (wall clock)."""
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    ends = np.array([e["t"] for e in events if e["event"] == "step_end"])
    parts = next((e for e in events if e["event"] == "loop_parts"), None)
    return Sample(np.diff(ends)[:-1], parts, float(ends[0] - launched))


def finite_or_none(value: float) -> float | None:
    """The value, or None for NaN (the JSON stays strict)."""
    return value if np.isfinite(value) else None


def median_of_finite(values: list[float | None]) -> float | None:
    """The median of the rounds that had a value; None if none had."""
    finite = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(finite)) if finite else None


def first_save_extra(per_round: list[float]) -> float | None:
    """The median over rounds; None where no round had two cadence saves (the JSON stays strict)."""
    return median_of_finite(per_round)


def run(cmd: list[str], env: dict, trace: Path) -> Sample:
    trace.unlink(missing_ok=True)
    launched = time.time()
    proc = run_child(cmd, env={**env, TRACE_ENV: str(trace)}, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return read_trace(trace, launched)


def wall_split(parts: list[dict]) -> dict:
    """Fractions of the loop's wall time by kind of work, summed over rounds (see the module docstring)."""
    wall = sum(p["wall_s"] for p in parts)
    total = {}
    for p in parts:
        for name, seconds in p["parts_s"].items():
            total[name] = total.get(name, 0.0) + seconds
    kinds = {"compute": ("compute",), "waiting_io": ("data", "checkpoint", "tracking"), "waiting_ranks": ("ranks",),
             "other": ("other",)}
    split = {kind: sum(total.get(n, 0.0) for n in names) / wall for kind, names in kinds.items()}
    return {**split, "parts_s": total, "wall_s": wall, "cpu_over_wall": sum(p["cpu_s"] for p in parts) / wall}


def paired_rounds(with_means: list[float], without_means: list[float]) -> list[float]:
    """Each round's (with / without - 1), the round's two runs adjacent in time: drift cancels."""
    return [w / wo - 1 for w, wo in zip(with_means, without_means, strict=True)]


def paired_overhead(with_means: list[float], without_means: list[float]) -> float:
    """Median over rounds of (with / without - 1) (:func:`paired_rounds`)."""
    return median_of_finite(paired_rounds(with_means, without_means))


def run_level_overheads(report: dict, cadence: int, amplify: int = 0) -> None:
    """The run-level checkpoint overheads (see the module docstring) into ``report``, and printed."""
    contenders = report["contenders"]
    without = contenders[WITHOUT_CHECKPOINTS]
    report["checkpoint_every"] = cadence
    report["target_run_level_overhead"] = TARGET_RUN_LEVEL_OVERHEAD
    # The same within-run figure for the run without cadence saves, at the same steps: the estimator's zero.
    report["within_run_control"] = median_of_finite(without.get("round_save_excess_share", []))
    if report["within_run_control"] is not None:
        print(f"within-run control (the run without cadence saves, same steps): "
              f"{100 * report['within_run_control']:+.2f}%")
    for kind, name, key in CHECKPOINT_KINDS:
        report[key] = contenders[name]["mean_ms"] / without["mean_ms"] - 1
        report[f"{key}_paired_rounds"] = paired_rounds(contenders[name]["round_means_ms"], without["round_means_ms"])
        report[f"{key}_paired"] = median_of_finite(report[f"{key}_paired_rounds"])
        # The same in the steady state (the second half: as many saves per step, none of the fixed costs).
        report[f"{key}_steady"] = contenders[name]["steady_ms"] / without["steady_ms"] - 1
        split, base = contenders[name].get("wall_split"), without.get("wall_split")
        # Less the run without cadence saves' own time in saves: both save the final step.
        share = ((split["parts_s"].get("checkpoint", 0.0) - base["parts_s"].get("checkpoint", 0.0)) / split["wall_s"]
                 if split and base else None)
        contenders[name]["checkpoint_share_of_wall"] = share
        # Within each run (no other run compared): the saves' excess over the steps around them (Sample).
        report[f"{key}_within_run_rounds"] = contenders[name].get("round_save_excess_share", [])
        within = report[f"{key}_within_run"] = median_of_finite(report[f"{key}_within_run_rounds"])
        print(f"run-level checkpoint overhead, {kind} saves every {cadence} steps: {100 * report[key]:+.2f}% "
              f"(paired by round {100 * report[f'{key}_paired']:+.2f}%"
              + (f", in saves by the trainer's clock {100 * share:.2f}%" if share is not None else "")
              + (f", within each run {100 * within:+.2f}%" if within is not None else "")
              + f"; target <= {100 * TARGET_RUN_LEVEL_OVERHEAD:.1f}%); steady state {100 * report[f'{key}_steady']:+.2f}%"
              + (f", the first save's fixed extra {extra:.2f} s" if (extra := contenders[name]["first_save_extra_s"])
                 is not None else ""))
        dense = contenders.get(amplified(name, amplify))
        if dense is not None and (saves := saves_timed(report["steps"], dense["checkpoint_every"])):
            # One save per default cadence: the dense runs' per-save cost over ``cadence`` steps.
            scale = (report["steps"] - 2) / (saves * cadence)
            report[f"{key}_amplified_rounds"] = [scale * r for r in paired_rounds(dense["round_means_ms"],
                                                                                  without["round_means_ms"])]
            report[f"{key}_amplified"] = median_of_finite(report[f"{key}_amplified_rounds"])
            print(f"run-level checkpoint overhead, {kind}, from runs saving every {dense['checkpoint_every']} steps "
                  f"scaled to one save per {cadence}: {100 * report[f'{key}_amplified']:+.2f}%")


def targets(report: dict) -> dict:
    """Each of #41's bars with the figures it is checked on: the paired steady ratios (adjacent runs) for the step;
    for the checkpoint cadence (sync and async), the paired run-level overheads and, where measured, the
    within-run and the amplified whole-run ones.

    ``met`` compares the median with the bar. Where the rounds are known, ``interval`` is the median's
    distribution-free interval (:func:`worldpipe.measure.contender_order.median_interval`, its ``coverage`` beside it) and
    ``verdict`` says what the rounds can tell: ``met`` (the whole interval at or under the bar), ``not met`` (the
    whole interval above it) or ``unresolved`` (the bar inside it: more rounds, or a quieter machine, decide).
    """
    checks = {}
    for name, bar in TARGET_STEADY_RATIO.items():
        contender = report["contenders"][name]
        rounds = [1 + r for r in contender["paired_steady_rounds"]] if "paired_steady_rounds" in contender else None
        checks[f"{name} steady step / bare loop's"] = (contender["paired_steady_ratio_vs_bare"], bar, rounds)
    for kind, _, key in CHECKPOINT_KINDS:
        checks[f"run-level checkpoint overhead, {kind}, paired"] = (report[f"{key}_paired"], TARGET_RUN_LEVEL_OVERHEAD,
                                                                    report.get(f"{key}_paired_rounds"))
        if report.get(f"{key}_within_run") is not None:
            checks[f"run-level checkpoint overhead, {kind}, within run"] = (
                report[f"{key}_within_run"], TARGET_RUN_LEVEL_OVERHEAD, report.get(f"{key}_within_run_rounds"))
        if report.get(f"{key}_amplified") is not None:
            checks[f"run-level checkpoint overhead, {kind}, whole run amplified"] = (
                report[f"{key}_amplified"], TARGET_RUN_LEVEL_OVERHEAD, report.get(f"{key}_amplified_rounds"))
    return {name: check(value, bar, rounds) for name, (value, bar, rounds) in checks.items()}


def check(value: float, bar: float, rounds: list[float | None] | None) -> dict:
    """One target's entry of :func:`targets`."""
    entry = {"value": value, "bar": bar, "met": bool(value <= bar)}
    finite = [r for r in rounds or [] if r is not None and np.isfinite(r)]
    if finite:
        low, high, coverage = median_interval(finite)
        entry.update(interval=[low, high], coverage=coverage,
                     verdict="met" if high <= bar else "not met" if low > bar else "unresolved")
    return entry


def has_compile_option() -> bool:
    from worldpipe.config.compose import compose_config

    try:
        return "compile" in compose_config([]).trainer
    except Exception:
        return False


def default_cadence() -> int:
    """``checkpoint.every`` as conf/checkpoint ships it (an experiment such as smoke may save far more often)."""
    from worldpipe.config.compose import compose_config  # keeps --help instant

    return int(compose_config([]).checkpoint.every)


def contenders(work: Path, args, round_: int) -> dict[str, list[str]]:
    common = [f"experiment={args.experiment}", "parallel=single", f"data.store={work}/store.zarr",
              f"data.manifest={work}/manifest.json", f"trainer.steps={args.steps}", "trainer.progress_bar=false"]
    train = [sys.executable, "-m", "worldpipe.cli", "train", *common]
    off = ["tracking.enabled=false", f"checkpoint.every={args.steps}"]
    out = {
        "bare loop": [sys.executable, str(work / "bare.py"), *common],
        "trainer": [*train, *off, f"run_dir={work}/plain-{round_}"],
        "trainer + tracking": [*train, f"checkpoint.every={args.steps}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                               f"run_dir={work}/tracked-{round_}"],
        WITH_CHECKPOINTS: [*train, f"checkpoint.every={args.cadence}", f"tracking.uri=sqlite:///{work}/mlflow.db",
                           f"run_dir={work}/full-{round_}"],
        WITH_ASYNC_CHECKPOINTS: [*train, f"checkpoint.every={args.cadence}", "checkpoint.async_save=true",
                                 f"tracking.uri=sqlite:///{work}/mlflow.db", f"run_dir={work}/async-{round_}"],
    }
    dense = amplified_cadence(args.cadence, args.amplify)
    if dense is not None:
        for name, label in ((WITH_CHECKPOINTS, "full-amp"), (WITH_ASYNC_CHECKPOINTS, "async-amp")):
            out[amplified(name, args.amplify)] = [*(f"checkpoint.every={dense}" if a.startswith("checkpoint.every=")
                                                    else f"run_dir={work}/{label}-{round_}" if a.startswith("run_dir=")
                                                    else a for a in out[name])]
    if has_compile_option() and not args.no_compile:
        out["trainer, compiled"] = [*train, *off, "trainer.compile=true", f"run_dir={work}/compiled-{round_}"]
    return out


def main(args: Namespace) -> int:
    args.cadence = default_cadence()
    env = {k: v for k, v in os.environ.items() if k not in (TRACE_ENV, "MLFLOW_TRACKING_URI")}
    report = {"benchmark": "loop", "experiment": args.experiment, "steps": args.steps,
              "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version()},
              "contenders": {}}
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        work = Path(tmp)
        spec = DatasetSpec(name="loop", env_id="Pendulum-v1", policy="noisy_controller", episodes=32, max_steps=64,
                           episodes_per_shard=8, seed=0)
        build_dataset(str(work / "store.zarr"), spec, manifest_path=str(work / "manifest.json"))
        (work / "bare.py").write_text(BARE_LOOP)
        import mlflow

        mlflow.MlflowClient(f"sqlite:///{work}/mlflow.db").search_experiments()  # store created outside timings

        def measure(name: str, cmd: list[str], round_: int) -> Sample:
            sample = run(cmd, env, work / "trace.jsonl")
            print(f"round {round_}: {name:58s} mean {1e3 * sample.times.mean():7.2f} ms/step")
            return sample

        # Fresh run directories every round (no resume); the order changes (worldpipe.measure.contender_order).
        samples = run_rounds(args.rounds, lambda round_: contenders(work, args, round_), measure)
        for name, rounds in samples.items():
            dense = name in {amplified(n, args.amplify) for _, n, _ in CHECKPOINT_KINDS}
            cadence = amplified_cadence(args.cadence, args.amplify) if dense else args.cadence
            means = [1e3 * float(s.times.mean()) for s in rounds]
            steady = [1e3 * float(s.steady.mean()) for s in rounds]
            report["contenders"][name] = {"mean_ms": median_of_means(means), "round_means_ms": means,
                                          "median_ms": 1e3 * float(np.median(np.concatenate([s.times for s in rounds]))),
                                          "steady_ms": median_of_means(steady), "round_steady_ms": steady,
                                          "startup_s": float(np.median([s.startup_s for s in rounds])),
                                          "steps_timed": int(sum(len(s.times) for s in rounds)),
                                          "checkpoint_every": cadence,
                                          "first_save_extra_s": first_save_extra([s.first_save_extra_s(cadence)
                                                                                  for s in rounds]),
                                          "round_save_excess_share": [finite_or_none(s.save_excess_share(cadence))
                                                                      for s in rounds]}
            if all(s.parts for s in rounds):
                report["contenders"][name]["wall_split"] = wall_split([s.parts for s in rounds])
    base = report["contenders"]["bare loop"]
    width = max(map(len, report["contenders"]))
    print(f"{'':{width}s} {'start-up':>9s}  {'per step over the run':>24s}  {'steady state (2nd half)':>26s}  "
          f"{'paired steady':>13s}")
    for name, c in report["contenders"].items():
        c["ratio_vs_bare_mean"] = c["mean_ms"] / base["mean_ms"]
        c["marginal_overhead_ms"] = c["mean_ms"] - base["mean_ms"]
        c["steady_ratio_vs_bare"] = c["steady_ms"] / base["steady_ms"]
        c["paired_steady_rounds"] = paired_rounds(c["round_steady_ms"], base["round_steady_ms"])
        c["paired_steady_ratio_vs_bare"] = 1 + median_of_finite(c["paired_steady_rounds"])
        c["startup_extra_s"] = c["startup_s"] - base["startup_s"]
        print(f"{name:{width}s} {c['startup_s']:8.2f}s  {c['mean_ms']:7.2f} ms = {c['ratio_vs_bare_mean']:5.3f}x bare  "
              f"{c['steady_ms']:7.2f} ms = {c['steady_ratio_vs_bare']:5.3f}x bare  "
              f"{c['paired_steady_ratio_vs_bare']:12.3f}x")
    report["loop_ratio"] = report["contenders"]["trainer"]["ratio_vs_bare_mean"]
    report["steady_loop_ratio"] = report["contenders"]["trainer"]["steady_ratio_vs_bare"]
    report["steady_tracking_ratio"] = report["contenders"]["trainer + tracking"]["steady_ratio_vs_bare"]
    run_level_overheads(report, args.cadence, args.amplify)
    report["targets"] = targets(report)
    for name, entry in report["targets"].items():
        print(f"target {name}: {entry['value']:.4f} against {entry['bar']} ({'met' if entry['met'] else 'NOT met'}"
              + (f"; {entry['coverage']:.0%} interval of the median {entry['interval'][0]:.4f}.."
                 f"{entry['interval'][1]:.4f}: {entry['verdict']}" if "interval" in entry else "") + ")")
    for name, c in report["contenders"].items():
        if "wall_split" in c:
            w = c["wall_split"]
            print(f"{name:{width}s} wall: compute {w['compute']:.1%}, waiting on I/O {w['waiting_io']:.1%}, "
                  f"waiting on ranks {w['waiting_ranks']:.1%}, other {w['other']:.1%}; CPU/wall {w['cpu_over_wall']:.2f}")
    publish_result(report, args.out, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Time per step against the bare loop, and where each trainer contender's wall time went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["contenders"])
    fig, (ax, split_ax) = plt.subplots(1, 2, figsize=(14, 4))
    ax.barh(names, [report["contenders"][n]["mean_ms"] for n in names], color="tab:blue",
            label="mean over the run (steps 2..N-1)")
    ax.scatter([report["contenders"][n]["steady_ms"] for n in names], names, color="tab:orange", marker="D",
               zorder=3, label="steady state (second half)")
    ax.scatter([report["contenders"][n]["median_ms"] for n in names], names, color="k", zorder=3, label="median")
    ax.set_yticks(range(len(names)), [f"{n} (start-up {report['contenders'][n]['startup_s']:.1f} s)" for n in names],
                  fontsize=8)
    ax.set_xlabel("ms per step (start-up, a fixed cost, in the labels)")
    ax.set_title(f"Training loop vs bare torch loop ({report['experiment']}, {report['steps']} steps)\n"
                 f"checkpoints every {report['checkpoint_every']} steps: "
                 f"{100 * report['run_level_checkpoint_overhead']:+.1f}% run-level "
                 f"(async {100 * report['run_level_async_checkpoint_overhead']:+.1f}%) "
                 f"(target <= {100 * report['target_run_level_overhead']:.1f}%)", fontsize=9)
    ax.legend()
    split = [n for n in names if "wall_split" in report["contenders"][n]]
    left = np.zeros(len(split))
    for kind, colour in (("compute", "tab:blue"), ("waiting_io", "tab:orange"), ("waiting_ranks", "tab:red"),
                         ("other", "tab:gray")):
        widths = np.array([report["contenders"][n]["wall_split"][kind] for n in split])
        split_ax.barh(split, widths, left=left, color=colour, label=kind.replace("_", " "))
        left += widths
    split_ax.set_xlabel("fraction of the training loop's wall time (CPU/wall in the labels)")
    split_ax.set_yticks(range(len(split)), [f"{n} ({report['contenders'][n]['wall_split']['cpu_over_wall']:.2f})"
                                            for n in split], fontsize=8)
    split_ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


COMMAND = Benchmark("loop", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

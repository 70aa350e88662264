"""Model step vs the machine: one eager forward+backward of an experiment's model against the matmul peak.

Everything in one process and one run, on ``--threads`` intra-op threads (default 1, what a rank gets):

* ``peak``: the fp32 ``torch.mm`` rate of square matrices (the best of ``--mm-sizes``), the ceiling any
  dense model step can approach on this machine;
* ``model``: the experiment's model as it is (``worldpipe.models``), one training step = forward, backward of
  the loss over a random batch of the config's shape (B = trainer.batch_size, T = data.window), zeroed grads;
* ``per-step RSSM`` (baseline, RSSM experiments only): the same weights with the filter written the way it used
  to be, every layer inside the Python loop over time (kept here only, as the before of the batched filter);
* ``python-loop core`` (RSSM experiments only): the batched filter with its loops through time in Python, the
  reference the compiled core (``worldpipe/models/native/filter_core.cpp``) computes to the same bits (the
  difference is the interpreter and ATen's per-call costs between operators).

FLOPs of one step come from ``torch.utils.flop_counter.FlopCounterMode`` (matmuls; element-wise work is not
counted), so ``fraction of peak = FLOPs / step time / peak``. The compiled core's per-step products call BLAS
below the dispatcher, where the counter does not see them, so an RSSM model's FLOPs (and its matmul floor) are
those of the python-loop core: the same products on the same operands. Contenders run in rounds whose order changes
(:mod:`worldpipe.measure.contender_order`); each is the median over rounds of its per-round mean. Target: the model's
step at >= 0.4 of the same run's peak. The peak is a best-of (the fastest call); on a busy machine a mean step
time is not, so ``fraction_of_peak_best`` (the fastest step against the same peak) is reported beside it, and
``fraction_of_peak_cpu``: the step's FLOPs over its thread CPU time against the peak by CPU time (both the calling
thread's ``time.thread_time``), which time other processes take from this one does not enter.

``matmul_floor``: every matmul one model step makes (recorded by a dispatch mode, grouped by operand shapes and
strides) replayed alone on fresh operands, best of 30 calls each, summed: the step's time if it did nothing but
its matmuls. Its fraction of peak is the most these shapes allow (16-row GEMMs reach half the peak here); its
share of the step says how much of the rest is element-wise work, copies and dispatch; ``operator_calls``
counts every operator the step calls (views included), each paying the dispatcher's fixed cost.
"""

from __future__ import annotations

import os
import platform
import time
from argparse import Namespace
from pathlib import Path

import click
import torch

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.figures import save_figure
from worldpipe.measure.contender_order import median_of_means, run_rounds
from worldpipe.measure.publish import publish_result
from worldpipe.models import build_model
from worldpipe.models.rssm import RSSM

TARGET_FRACTION_OF_PEAK = 0.4
BASELINE = "per-step RSSM"
PYTHON_CORE = "python-loop core"


class PythonCoreRSSM(RSSM):
    """The RSSM with the Python reference of the filter's loops through time."""

    compiled_core = False


class PerStepRSSM(RSSM):
    """The RSSM with every layer inside the loop over time: the filter before it was batched (baseline only)."""

    def observe(self, obs, action, noise):
        embed = self.encoder(obs)
        h, z = self.initial_state(obs)
        out = {k: [] for k in ("h", "z", "prior_mean", "prior_std", "post_mean", "post_std")}
        for t in range(obs.shape[1]):
            if t > 0:
                h = self.transition(h, z, action[:, t - 1])
            prior_mean, prior_std = self._gaussian(self.prior_head(h))
            post_mean, post_std = self._gaussian(self.posterior_head(torch.cat([h, embed[:, t]], dim=-1)))
            z = post_mean + post_std * noise[:, t]
            for key, value in zip(out, (h, z, prior_mean, prior_std, post_mean, post_std), strict=True):
                out[key].append(value)
        return {key: torch.stack(values, dim=1) for key, values in out.items()}


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/step.json", help="JSON result (a plot beside it)"),
    click.Option(["--experiment"], default="pendulum_rssm", help="experiment whose model and batch shape are timed"),
    click.Option(["--env"], default="Pendulum-v1", help="environment of the experiment's data (observation sizes)"),
    click.Option(["--threads"], type=int, default=1, help="intra-op threads (one rank's share: 1)"),
    click.Option(["--rounds"], type=int, default=5, help="rounds of every contender (median of round means)"),
    click.Option(["--steps"], type=int, default=20, help="timed steps per contender per round (after 3 warm-up)"),
    click.Option(["--mm-sizes"], default="256,512,1024", help="square matmul sizes; the best rate is the peak"),
]

def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


def experiment_shapes(experiment: str, env_id: str) -> tuple[dict, int, int, int, int]:
    """(model config, B, T, O, A) of an experiment's composed config and its environment."""
    from omegaconf import OmegaConf

    from worldpipe.data.environments import env_dims
    from worldpipe.launch.launcher import compose_config

    cfg = compose_config([f"experiment={experiment}"])
    dims = env_dims(env_id)
    return (OmegaConf.to_container(cfg.model, resolve=True), int(cfg.trainer.batch_size), int(cfg.data.window),
            dims.obs_dim, dims.act_dim)


def make_step(model: torch.nn.Module, batch: dict):
    """One eager training step (forward, backward of the summed loss, grads dropped) as a closure."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        sums = model(batch["obs"], batch["action"], batch["reward"], batch["mask"], batch["noise"])
        sums["total"].backward()
    return step


def step_flops(step) -> int:
    """FLOPs of one call of ``step`` (FlopCounterMode: matmul-class operators, forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


def timed(fn, calls: int, warmup: int = 3, cpu: list[float] | None = None) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn`` after ``warmup`` untimed ones; the calling thread's CPU seconds
    of each call are appended to ``cpu`` when given."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        out.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.thread_time() - start_cpu)
    return out


MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _operand_like(t: torch.Tensor) -> torch.Tensor:
    """A random tensor of ``t``'s shape and strides (a transposed operand stays transposed: MKL's path differs)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).normal_()


def step_matmuls(step, operators: dict[str, int] | None = None) -> dict[tuple, dict]:
    """The matmul-class calls of one call of ``step``, grouped by operator and operand shapes and strides; every
    operator call (views included) counted by name into ``operators`` when given."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: dict[tuple, dict] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if operators is not None:
                operators[name] = operators.get(name, 0) + 1
            if name in MATMULS:
                tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
                outputs = {k: v for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)}  # out= forms
                key = (name, *((tuple(t.shape), t.stride()) for t in tensors))
                calls.setdefault(key, {"func": func, "operands": tensors, "outputs": outputs, "count": 0})["count"] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    return calls


def operators_called(step) -> dict[str, int]:
    """Operator calls (views included) one call of ``step`` makes through the dispatcher, by name."""
    operators: dict[str, int] = {}
    step_matmuls(step, operators)
    return operators


def matmul_floor(step, repeat: int = 30) -> dict:
    """Milliseconds of one step's matmuls alone, each shape replayed on fresh operands (best of ``repeat``
    calls): the time the step would take if it did nothing else; its matmul calls beside it."""
    total, shapes = 0.0, []
    for key, call in step_matmuls(step).items():
        operands = [_operand_like(t) for t in call["operands"]]
        outputs = {k: _operand_like(t) for k, t in call["outputs"].items()}
        best = min(timed(lambda f=call["func"], o=operands, out=outputs: f(*o, **out), calls=repeat, warmup=3))
        total += best * call["count"]
        shapes.append({"op": key[0], "shapes": [list(shape) for shape, _ in key[1:]], "calls": call["count"],
                       "best_us": 1e6 * best})
    return {"ms": 1e3 * total, "calls": sum(s["calls"] for s in shapes), "distinct_shapes": len(shapes),
            "shapes": shapes}


def mm_peak(sizes: list[int], cpu_rates: dict[str, float] | None = None) -> dict[str, float]:
    """GFLOP/s of fp32 ``torch.mm`` per square size (best of a few calls each); by CPU time into ``cpu_rates``."""
    rates = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        cpu: list[float] = []
        best = min(timed(lambda a=a, b=b: torch.mm(a, b), calls=max(3, int(2e9 / n**3)), warmup=2, cpu=cpu))
        rates[str(n)] = 2 * n**3 / best / 1e9
        if cpu_rates is not None:
            cpu_rates[str(n)] = 2 * n**3 / max(min(cpu), 1e-6) / 1e9
    return rates


def model_and_batch(experiment: str, env_id: str) -> tuple[dict, torch.nn.Module, dict]:
    """(model config, the experiment's model seeded with 0, one random batch of its shape)."""
    model_cfg, batch_size, window, obs_dim, act_dim = experiment_shapes(experiment, env_id)
    torch.manual_seed(0)
    model = build_model(model_cfg, obs_dim, act_dim)
    g = torch.Generator().manual_seed(0)
    noise_shape = model.noise_shape(window)
    batch = {"obs": torch.randn(batch_size, window, obs_dim, generator=g),
             "action": torch.randn(batch_size, window, act_dim, generator=g),
             "reward": torch.randn(batch_size, window, generator=g), "mask": torch.ones(batch_size, window),
             "noise": None if noise_shape is None else torch.randn(batch_size, *noise_shape, generator=g)}
    return model_cfg, model, batch


def contenders(args) -> tuple[dict, dict]:
    """Step closures by name (the baseline first when there is one) and what the report says about the model."""
    model_cfg, model, batch = model_and_batch(args.experiment, args.env)
    obs_dim, act_dim = batch["obs"].shape[-1], batch["action"].shape[-1]
    batch_size, window = batch["obs"].shape[:2]
    steps = {}
    if type(model) is RSSM:
        for name, cls in ((BASELINE, PerStepRSSM), (PYTHON_CORE, PythonCoreRSSM)):
            same = cls(obs_dim, act_dim, **{k: v for k, v in model_cfg.items() if k != "_target_"})
            same.load_state_dict(model.state_dict())
            steps[name] = make_step(same, batch)
    steps["model"] = make_step(model, batch)
    about = {"model": model_cfg["_target_"], "batch": batch_size, "window": window,
             "parameters": sum(p.numel() for p in model.parameters())}
    return steps, about


def measure_rounds(args, steps: dict, cpu: dict[str, list]) -> dict[str, list]:
    """Per contender, one sample per round: mean seconds per step, or the matmul rates of that round.

    ``cpu`` receives the same by the thread's CPU time (a step's CPU seconds, the peak's CPU-time rates): on a
    machine other processes keep busy, wall time counts the time the scheduler gave them and CPU time does not.
    """
    sizes = [int(n) for n in args.mm_sizes.split(",")]
    specs = {"peak": None, **steps}

    def measure(name, step, round_):
        if name == "peak":
            cpu_rates: dict[str, float] = {}
            rates = mm_peak(sizes, cpu_rates)
            cpu.setdefault(name, []).append(cpu_rates)
            print(f"round {round_}: peak {max(rates.values()):7.1f} GFLOP/s  {rates}")
            return rates
        cpu_times: list[float] = []
        times = timed(step, args.steps, cpu=cpu_times)
        cpu.setdefault(name, []).append(cpu_times)
        print(f"round {round_}: {name:14s} {1e3 * sum(times) / len(times):7.2f} ms/step (best {1e3 * min(times):.2f})")
        return times

    return run_rounds(args.rounds, lambda round_: specs, measure)


def summarize(samples: dict, flops: dict, about: dict, args, load_before, cpu: dict) -> dict:
    """The report: per contender its step time, FLOPs, GFLOP/s and fraction of the same run's peak (by wall time,
    and by the thread's CPU time)."""
    peak_rounds = [max(r.values()) for r in samples.pop("peak")]
    peak = median_of_means(peak_rounds)
    peak_cpu = median_of_means(max(r.values()) for r in cpu.pop("peak"))
    report = {"benchmark": "step", "experiment": args.experiment, **about, "threads": args.threads,
              "rounds": args.rounds, "steps_per_round": args.steps,
              "machine": {"cpus": os.cpu_count(), "load_average_before": list(load_before),
                          "load_average_after": list(os.getloadavg()), "python": platform.python_version(),
                          "torch": torch.__version__},
              "peak_gflops": peak, "peak_round_gflops": peak_rounds, "contenders": {}}
    for name, rounds in samples.items():
        step_s, best_s = median_of_means(rounds), min(min(r) for r in rounds)
        gflops = flops[name] / step_s / 1e9
        report["contenders"][name] = {"step_ms": 1e3 * step_s, "round_step_ms": [1e3 * sum(r) / len(r) for r in rounds],
                                      "flops": flops[name], "gflops": gflops, "fraction_of_peak": gflops / peak,
                                      "best_step_ms": 1e3 * best_s,
                                      "fraction_of_peak_best": flops[name] / best_s / 1e9 / peak,
                                      "cpu_step_ms": 1e3 * median_of_means(cpu[name]),
                                      "fraction_of_peak_cpu": flops[name] / median_of_means(cpu[name]) / 1e9
                                      / peak_cpu}
    model = report["contenders"]["model"]
    report["fraction_of_peak"] = model["fraction_of_peak"]
    report["peak_gflops_cpu"] = peak_cpu
    report["fraction_of_peak_cpu"] = model["fraction_of_peak_cpu"]
    report["target_fraction_of_peak"] = TARGET_FRACTION_OF_PEAK
    report["meets_target"] = model["fraction_of_peak"] >= TARGET_FRACTION_OF_PEAK
    if BASELINE in report["contenders"]:
        report["speedup_vs_per_step"] = report["contenders"][BASELINE]["step_ms"] / model["step_ms"]
        report["speedup_vs_python_core"] = report["contenders"][PYTHON_CORE]["step_ms"] / model["step_ms"]
    return report


def main(args: Namespace) -> int:
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    steps, about = contenders(args)
    flops = {name: step_flops(step) for name, step in steps.items()}
    counted_on = PYTHON_CORE if PYTHON_CORE in steps else "model"  # the same products, all visible (docstring)
    flops["model"] = flops[counted_on]
    floor = matmul_floor(steps[counted_on])
    floor["operator_calls_by_name"] = operators_called(steps["model"])  # the model's own, beside its floor
    floor["operator_calls"] = sum(floor["operator_calls_by_name"].values())
    cpu: dict[str, list] = {}
    samples = measure_rounds(args, steps, cpu)
    report = summarize(samples, flops, about, args, load_before, cpu)
    report["contenders"]["model"]["flops_counted_on"] = counted_on
    # Beside the step: the fraction of peak the floor's shapes reach, and its share of the model's step time.
    floor["fraction_of_peak"] = flops["model"] / (floor["ms"] / 1e3) / 1e9 / report["peak_gflops"]
    floor["share_of_step"] = floor["ms"] / report["contenders"]["model"]["step_ms"]
    report["matmul_floor"] = floor
    for name, c in report["contenders"].items():
        print(f"{name:14s} {c['step_ms']:7.2f} ms/step  {c['flops'] / 1e6:7.1f} MFLOP  {c['gflops']:6.1f} GFLOP/s"
              f"  {c['fraction_of_peak']:.3f} of peak (best step {c['best_step_ms']:.2f} ms: "
              f"{c['fraction_of_peak_best']:.3f}; by CPU time {c['cpu_step_ms']:.2f} ms: {c['fraction_of_peak_cpu']:.3f})")
    print(f"peak {report['peak_gflops']:.1f} GFLOP/s (fp32 mm, {args.threads} thread(s)); model step at "
          f"{report['fraction_of_peak']:.3f} of peak (target >= {TARGET_FRACTION_OF_PEAK}); by CPU time "
          f"{report['fraction_of_peak_cpu']:.3f} of the CPU-time peak {report['peak_gflops_cpu']:.1f} GFLOP/s")
    print(f"matmul floor: the step's {floor['calls']} matmuls ({floor['distinct_shapes']} shapes) alone take "
          f"{floor['ms']:.2f} ms = {floor['fraction_of_peak']:.3f} of peak at best; they are "
          f"{floor['share_of_step']:.0%} of the model's step, the other {1 - floor['share_of_step']:.0%} is "
          f"element-wise work, copies and dispatch of {floor['operator_calls']} operator calls per step")
    publish_result(report, args.out, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Fraction of peak per contender, with the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["contenders"])
    fig, ax = plt.subplots(figsize=(8, 3))
    fractions = [report["contenders"][n]["fraction_of_peak"] for n in names]
    ax.barh(names, fractions, color="tab:blue")
    for i, n in enumerate(names):
        ax.text(fractions[i], i, f" {report['contenders'][n]['step_ms']:.1f} ms", va="center")
    ax.axvline(report["target_fraction_of_peak"], color="tab:red", ls="--", label="target")
    ax.set_xlabel(f"fraction of fp32 mm peak ({report['peak_gflops']:.0f} GFLOP/s, {report['threads']} thread)")
    ax.set_title(f"{report['experiment']}: eager forward+backward, B={report['batch']} T={report['window']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


COMMAND = Benchmark("step", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

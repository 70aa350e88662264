"""Rollout serving: latency and throughput together under open-loop load, with and without batching.

Starts the real HTTP service (`worldpipe serve`, a subprocess on 127.0.0.1) once per batching setting and
offers Poisson load at increasing rates (fresh samples: the result cache never helps). For each setting: p50/
p95/p99 end-to-end latency and achieved throughput vs offered rate, and the knee (the last rate served with
achieved >= 90% of offered, every request finished). Baseline: the same model served without
batching (max batch 1), in the same run. Also: a serial control loop's budget by part, memory by category,
rollout-state size vs horizon for every model in conf/model/, and energy (or "unavailable").
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from pathlib import Path

import click
import numpy as np
import requests
import torch

from worldpipe.checkpoint.layout import resolve_location
from worldpipe.commands import RUN_HELP
from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.core.children import start_child
from worldpipe.core.figures import save_figure
from worldpipe.measure.energy import EnergyMeter
from worldpipe.measure.load import run_open_loop
from worldpipe.measure.memory import LiveTensorPeak
from worldpipe.measure.publish import publish_result
from worldpipe.measure.timers import Timeline
from worldpipe.models import build_model, state_nbytes
from worldpipe.rollout.demo import MODEL_CONF_DIR, model_config, publish_demo_checkpoint
from worldpipe.rollout.registry import load_served_model

SETTINGS = {"no batching": (1, 0.0), "batch 8 / 2 ms": (8, 2.0), "batch 32 / 5 ms": (32, 5.0)}
RATES = (5, 10, 20, 40, 80, 160, 320, 640)
CONTEXT, HORIZON = 8, 16
HORIZONS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/rollout.json", help="JSON result (a plot beside it)"),
    click.Option(["--checkpoint"], metavar="RUN", show_default="a demo RSSM of conf/model/rssm.yaml",
                 help=f"serve this run's checkpoint ({RUN_HELP})"),
    click.Option(["--duration-s"], type=float, default=3.0, help="seconds of load per offered rate"),
    click.Option(["--loop-steps"], type=int, default=40, help="iterations of the serial control loop"),
]


def parse_args(argv=None) -> Namespace:
    return COMMAND.parse(argv)


class Server:
    """`worldpipe serve` on a free port; stopped by PID."""

    def __init__(self, checkpoint: str, workdir: Path, max_batch: int, wait_ms: float) -> None:
        port_file = workdir / f"port-{max_batch}"
        cmd = [sys.executable, "-m", "worldpipe.cli", "serve", checkpoint, "--port", "0", "--port-file",
               str(port_file), "--max-batch", str(max_batch), "--max-wait-ms", str(wait_ms)]
        with open(workdir / "server.log", "ab") as log:
            self.proc = start_child(cmd, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; see {workdir / 'server.log'}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def request_body(i: int, obs_dim: int, act_dim: int, stream: str | None = None) -> dict:
    rng = np.random.default_rng(i)
    body = {"context": {"obs": rng.normal(size=(CONTEXT, obs_dim)).tolist(),
                        "action": rng.uniform(-1, 1, (CONTEXT, act_dim)).tolist()},
            "actions": rng.uniform(-1, 1, (HORIZON, act_dim)).tolist()}
    if stream is not None:
        body["rng"] = {"seed": 0, "stream": stream}
    return body


def sweep(server: Server, dims: tuple[int, int], duration_s: float) -> list[dict]:
    """Offered-rate sweep; stops one rate past saturation so the backlog stays bounded."""
    local = threading.local()
    bodies = [json.dumps(request_body(i, *dims)) for i in range(64)]

    def send(i: int) -> None:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        r = session.post(server.url + "/rollout", data=bodies[i % len(bodies)], timeout=60,
                         headers={"content-type": "application/json"})
        r.raise_for_status()

    points = []
    for rate in RATES:
        point = run_open_loop(send, rate, duration_s, drain_s=5.0, seed=rate)
        points.append(point)
        print(f"  offered {rate:5d}/s  achieved {point['achieved_rps']:7.1f}/s  p50 {point['p50_ms'] or 0:8.1f} ms"
              f"  p99 {point['p99_ms'] or 0:8.1f} ms  unfinished {point['unfinished']}")
        if point["achieved_rps"] < 0.8 * rate:
            break
    return points


def knee(points: list[dict]) -> dict | None:
    """The highest offered rate before saturation: every request finished and achieved >= 90% of offered.

    Latency is reported at that rate, not used to pick it: one noisy p99 must not move the knee.
    """
    best = None
    for p in points:
        if p["unfinished"] or p["failed"] or p["achieved_rps"] < 0.9 * p["offered_rps"]:
            break
        best = p
    return None if best is None else {"offered_rps": best["offered_rps"], "achieved_rps": best["achieved_rps"],
                                      "p50_ms": best["p50_ms"], "p99_ms": best["p99_ms"]}


def control_loop(server: Server, dims: tuple[int, int], steps: int) -> dict:
    """A serial loop: prepare -> transport -> (server: input, queue, model, output) -> parse -> decide."""
    session, line = requests.Session(), Timeline()
    obs_dim, act_dim = dims
    history = np.zeros((CONTEXT, obs_dim)), np.zeros((CONTEXT, act_dim))
    plan = np.zeros((HORIZON, act_dim))
    for step in range(steps):
        with line.part("input preparation"):
            data = json.dumps({"context": {"obs": history[0].tolist(), "action": history[1].tolist()},
                               "actions": plan.tolist(), "rng": {"seed": 0, "stream": f"loop-{step}"}})
        sent = time.perf_counter()
        reply = session.post(server.url + "/rollout", data=data, headers={"content-type": "application/json"},
                             timeout=60)
        received = time.perf_counter()
        with line.part("output handling"):
            result = reply.json()
            predicted = np.asarray(result["observations"])
        timing = result["timing"]
        # The server's parts happen inside the round trip; what is left of it is transport + HTTP framing.
        parts = [("server input", timing["input_s"]), ("queueing", timing["queue_s"]),
                 ("model work", timing["model_s"]),
                 ("server output+cache", timing["service_s"] - timing["queue_s"] - timing["model_s"]
                  + timing["output_s"])]
        transport = (received - sent) - sum(d for _, d in parts)
        cursor = sent + transport / 2
        line.add("transport", sent, cursor)
        for name, duration in parts:
            line.add(name, cursor, cursor + duration)
            cursor += duration
        line.add("transport", cursor, received)
        with line.part("decision"):
            plan = np.roll(plan, -1, axis=0)
            plan[-1] = -np.clip(predicted[-1, :act_dim], -1, 1)
            history = (np.roll(history[0], -1, 0), np.roll(history[1], -1, 0))
            history[0][-1], history[1][-1] = predicted[0], plan[0]
    wall = line.spans[-1][2] - line.spans[0][1]
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
            "critical_path_ms_per_step": {k: 1e3 * v / steps for k, v in line.critical_path().items()},
            "sum_of_parts_ms_per_step": {k: 1e3 * v / steps for k, v in line.totals().items()}}


def server_memory(server: Server, dims: tuple[int, int], sessions: int = 16) -> dict:
    """Memory by category as the server accounts it, with ``sessions`` open sessions."""
    opened = []
    for i in range(sessions):
        body = request_body(i, *dims, stream=f"mem-{i}")
        body.pop("actions")
        opened.append(requests.post(server.url + "/sessions", json=body, timeout=60).json())
    stats = requests.get(server.url + "/stats", timeout=60).json()
    for s in opened:
        requests.delete(f"{server.url}/sessions/{s['session_id']}", headers={"X-Session-Token": s["token"]},
                        timeout=60)
    memory = stats["memory"]
    return {**memory, "sessions_open": sessions, "state_bytes_per_session": memory["session_state"] / sessions}


def activation_peak(checkpoint: str, width: int = 8) -> dict:
    """Peak bytes of temporaries (activations) of one batched context filter and one imagined step."""
    root, step = resolve_location(checkpoint)
    from worldpipe.checkpoint import CheckpointManager

    served = load_served_model(root, step if step is not None else CheckpointManager(root).latest_intact())
    model = served.model
    obs, act = torch.randn(width, CONTEXT, served.obs_dim), torch.randn(width, CONTEXT, served.act_dim)
    with torch.no_grad():
        with LiveTensorPeak() as observe:
            state = model.observe_context(obs, act)
        noise_shape = model.rollout_noise_shape()
        noise = None if noise_shape is None else torch.randn(width, *noise_shape)
        with LiveTensorPeak() as step_peak:
            model.imagine_step(state, act[:, -1], noise)
    return {"batch_width": width, "context_filter_peak_bytes": observe.peak, "imagine_step_peak_bytes": step_peak.peak,
            "parameter_bytes": served.parameter_bytes, "state_bytes_per_row": state_nbytes(state) // width}


def state_growth() -> dict:
    """Rollout-state bytes per sequence vs horizon, for every model config in conf/model/."""
    out = {}
    for path in sorted(MODEL_CONF_DIR.glob("*.yaml")):
        torch.manual_seed(0)
        cfg = model_config(path.stem)
        # Frame models observe flattened frames (image_size² × 3 values a step); the others a 3-vector.
        obs_dim = int(cfg["image_size"]) ** 2 * 3 if "image_size" in cfg else 3
        model = build_model(cfg, obs_dim, 1).eval()
        noise_shape = model.rollout_noise_shape()
        sizes = []
        with torch.no_grad():
            state = model.observe_context(torch.zeros(1, CONTEXT, obs_dim), torch.zeros(1, CONTEXT, 1))
            for h in range(max(HORIZONS) + 1):
                if h in HORIZONS:
                    sizes.append(state_nbytes(state))
                noise = None if noise_shape is None else torch.zeros(1, *noise_shape)
                _, _, state = model.imagine_step(state, torch.zeros(1, 1), noise)
        out[path.stem] = {"state_grows": bool(model.state_grows), "horizons": list(HORIZONS), "bytes": sizes}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    lat, thr, mem, loop = axes.flat
    for name, setting in result["settings"].items():
        pts = [p for p in setting["points"] if p["p99_ms"] is not None]
        rates = [p["offered_rps"] for p in pts]
        line, = lat.plot(rates, [p["p99_ms"] for p in pts], marker="o", label=f"{name} p99")
        lat.plot(rates, [p["p50_ms"] for p in pts], ls="--", color=line.get_color(), label=f"{name} p50")
        if setting["knee"]:
            lat.scatter([setting["knee"]["offered_rps"]], [setting["knee"]["p99_ms"]], s=150, marker="*",
                        color=line.get_color(), zorder=5)
        thr.plot([p["offered_rps"] for p in setting["points"]], [p["achieved_rps"] for p in setting["points"]],
                 marker="o", label=name)
    offered = sorted({p["offered_rps"] for s in result["settings"].values() for p in s["points"]})
    thr.plot(offered, offered, color="gray", ls=":", label="achieved = offered")
    thr.set_yscale("log")
    for ax, title, ylabel in ((lat, "End-to-end latency vs offered load (★ = knee)", "latency (ms)"),
                              (thr, "Achieved vs offered throughput", "achieved (rollouts/s)")):
        ax.set_xscale("log")
        ax.set_xlabel("offered rate (rollouts/s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    for name, growth in result["state_growth"].items():
        mem.plot(growth["horizons"], growth["bytes"], marker="o",
                 label=f"{name} ({'grows: KV cache' if growth['state_grows'] else 'fixed-size state'})")
    mem.set_xlabel("imagined steps")
    mem.set_ylabel("rollout state bytes per sequence")
    mem.set_title("Rollout state vs horizon")
    mem.legend(fontsize=8)
    names = list(result["control_loop"])
    parts = sorted({k for v in result["control_loop"].values() for k in v["critical_path_ms_per_step"]})
    bottom = np.zeros(len(names))
    for part in parts:
        values = np.array([result["control_loop"][n]["critical_path_ms_per_step"].get(part, 0.0) for n in names])
        loop.bar(names, values, bottom=bottom, label=part)
        bottom += values
    loop.set_ylabel("ms per control step (critical path)")
    loop.set_title("Serial control loop budget")
    loop.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def main(args: Namespace) -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        workdir = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = str(workdir / "checkpoints")
            publish_demo_checkpoint(checkpoint, model_cfg=model_config("rssm"))
        result = {"benchmark": "rollout", "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
                                                      "python": platform.python_version(),
                                                      "torch": torch.__version__},
                  "request": {"context": CONTEXT, "horizon": HORIZON, "sampling": "fresh sample (no cache hits)"},
                  "checkpoint": "demo RSSM (conf/model/rssm.yaml, untrained)" if args.checkpoint is None else checkpoint,
                  "duration_s_per_rate": args.duration_s, "settings": {}, "control_loop": {}}
        for name, (max_batch, wait_ms) in SETTINGS.items():
            print(f"{name}: max batch {max_batch}, max wait {wait_ms} ms")
            server = Server(checkpoint, workdir, max_batch, wait_ms)
            try:
                health = requests.get(server.url + "/health", timeout=60).json()
                health_dims = (health["obs_dim"], health["act_dim"])
                meter = EnergyMeter()
                meter.start()
                points = sweep(server, health_dims, args.duration_s)
                completed = sum(p["completed"] for p in points)
                energy = meter.stop(completed, completed * HORIZON)
                result["settings"][name] = {"max_batch": max_batch, "max_wait_ms": wait_ms, "points": points,
                                            "knee": knee(points), "energy": energy}
                if name != "batch 32 / 5 ms":
                    result["control_loop"][name] = control_loop(server, health_dims, args.loop_steps)
                if name == "batch 8 / 2 ms":
                    result["memory"] = server_memory(server, health_dims)
            finally:
                server.stop()
        result["memory"]["activations"] = activation_peak(checkpoint)
        result["state_growth"] = state_growth()
        if not any(g["state_grows"] for g in result["state_growth"].values()):
            result["state_growth_note"] = ("no model in conf/model/ keeps a KV cache yet: only fixed-size recurrent "
                                           "state is shown; a transformer config appears here when it lands")
    summarize(result)
    publish_result(result, args.out, plot)
    return 0


def summarize(result: dict) -> None:
    base = result["settings"]["no batching"]["knee"]
    result["summary"] = {"knee": {n: s["knee"] for n, s in result["settings"].items()}}
    for name, setting in result["settings"].items():
        k = setting["knee"]
        ratio = (k["achieved_rps"] / base["achieved_rps"]) if k and base else None
        result["summary"][f"knee_throughput_ratio_vs_no_batching[{name}]"] = ratio
        print(f"knee {name:16s}: " + (f"{k['offered_rps']}/s at p99 {k['p99_ms']:.1f} ms"
                                      f" ({ratio:.2f}x no batching)" if k and ratio else "not reached"))
    for name, loop in result["control_loop"].items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in loop["critical_path_ms_per_step"].items())
        print(f"control loop ({name}): {loop['wall_ms_per_step']:.2f} ms/step = {parts}")
    print("energy:", result["settings"]["no batching"]["energy"].get("reason") or "measured")


COMMAND = Benchmark("rollout", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

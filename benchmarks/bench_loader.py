"""WindowLoader throughput vs. two baselines measured in the same run.

Baselines:
- ``mmap``: the same arrays written once as raw .npy files and gathered with numpy fancy indexing from
  ``np.load(mmap_mode="r")`` (same sampler, same outputs: normalised obs/reward, action, terminated,
  mask, torch tensors) in the calling thread -- the practical upper limit for this access pattern;
- ``demand``: windows/s a training step consumes (forward + backward + Adam step of a tiny GRU world
  model on a 16 x 32 batch).

Targets: loader/mmap >= 0.5 and loader/demand >= 10.

Pixel windows (``pixels``): frames/s the loader delivers from a store of rendered frames (``--pixel-size``,
zstd) against frames/s a PixelRSSM training step consumes (``conf/model/pixel_rssm.yaml``: forward + backward
+ Adam on the same [batch, window] frames, including the uint8 -> float normalization the trainer does).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from argparse import Namespace
from types import SimpleNamespace

import click
import numpy as np
import torch

from worldpipe.commands.bench import Benchmark
from worldpipe.config.paths import BENCH_DIR
from worldpipe.data.build import build_dataset
from worldpipe.data.loader import WindowLoader
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import TrajectoryStore

TARGET_VS_MMAP = 0.5
TARGET_VS_DEMAND = 10.0


OPTIONS = [
    click.Option(["--out"], default=f"{BENCH_DIR}/loader.json", help="JSON result"),
    click.Option(["--episodes"], type=int, default=256, help="episodes of the state store"),
    click.Option(["--max-steps"], type=int, default=200, help="steps per episode"),
    click.Option(["--episodes-per-shard"], type=int, default=16),
    click.Option(["--window"], type=int, default=32, help="steps per training window"),
    click.Option(["--batch"], type=int, default=16, help="windows per batch"),
    click.Option(["--batches"], type=int, default=3000, help="batches timed per loader measurement"),
    click.Option(["--demand"], type=float, default=None, help="training demand in windows/s (else measured)"),
    click.Option(["--repeats"], type=int, default=3, help="best-of repeats for each throughput number"),
    click.Option(["--pixel-size"], type=int, default=64, help="frame side of the pixel-window rows (0: skip them)"),
    click.Option(["--pixel-episodes"], type=int, default=16, help="episodes of the pixel store"),
    click.Option(["--pixel-demand"], type=float, default=None,
                 help="pixel training demand in frames/s (else measured with PixelRSSM)"),
]


def parse_args(argv: list[str] | None = None) -> Namespace:
    """Command-line options (all have small, CI-friendly defaults)."""
    return COMMAND.parse(argv)


def _tiny_gru_step(obs_dim: int, act_dim: int):
    """A forward+backward+Adam step of a tiny GRU dynamics model, as a function of a batch dict."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(obs_dim + act_dim, 64, batch_first=True)
    head = torch.nn.Linear(64, obs_dim)
    opt = torch.optim.Adam([*gru.parameters(), *head.parameters()], lr=1e-3)

    def step(batch: dict) -> None:
        obs, act = batch["obs"], batch["action"]
        hidden, _ = gru(torch.cat([obs[:, :-1], act[:, :-1]], dim=-1))
        loss = torch.nn.functional.mse_loss(head(hidden), obs[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def training_demand_windows_per_s(
    batch: int = 16, window: int = 32, obs_dim: int = 3, act_dim: int = 1, steps: int = 30
) -> float:
    """Windows/s consumed by forward+backward+step of a tiny GRU dynamics model on [batch, window]."""
    step = _tiny_gru_step(obs_dim, act_dim)
    data = {"obs": torch.randn(batch, window, obs_dim), "action": torch.randn(batch, window, act_dim)}
    for _ in range(3):
        step(data)
    start = time.perf_counter()
    for _ in range(steps):
        step(data)
    return batch * steps / (time.perf_counter() - start)


def _training_overhead(
    store: TrajectoryStore, args: Namespace, stats: dict, steps: int = 40
) -> float:
    """Relative slowdown of a tiny-GRU training step when its batch comes from the loader (next_batch +
    step) instead of being reused: median over alternating fed / fixed steps, so load spikes on a shared
    machine hit both sides alike and are filtered out."""
    step = _tiny_gru_step(store.obs_dim, store.act_dim)
    sampler = GlobalWindowSampler(store.lengths, args.window, 1, args.batch, seed=0)
    fed, alone = [], []
    with WindowLoader(store, sampler, rank=0, world_size=1, obs_stats=stats, prefetch=2) as loader:
        fixed = loader.next_batch()
        for _ in range(3):
            step(loader.next_batch())
        for _ in range(steps):
            t0 = time.perf_counter()
            step(loader.next_batch())
            t1 = time.perf_counter()
            step(fixed)
            t2 = time.perf_counter()
            fed.append(t1 - t0)
            alone.append(t2 - t1)
    return float(np.median(fed) / np.median(alone) - 1.0)


def pixel_training_demand_frames_per_s(size: int, batch: int, window: int, steps: int = 5) -> float:
    """Frames/s consumed by forward + backward + Adam of the configured PixelRSSM on [batch, window] frames."""
    from worldpipe.config.compose import compose_config
    from worldpipe.models import build_model, flat_observations

    torch.manual_seed(0)
    model_cfg = compose_config(["model=pixel_rssm", f"model.image_size={size}"]).model
    model = build_model(model_cfg, 3 * size * size, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    frames = torch.randint(0, 256, (batch, window, size, size, 3), dtype=torch.uint8)
    action, reward, mask = torch.randn(batch, window, 1), torch.randn(batch, window), torch.ones(batch, window)
    noise = torch.randn(batch, *model.noise_shape(window))

    def step() -> None:
        obs = (flat_observations({"pixels": frames}, "pixels") - model.obs_mean) / model.obs_std
        loss = model(obs, action, reward, mask, noise)["total"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * window * steps / (time.perf_counter() - start)


def _pixel_rows(tmp: str, args: Namespace) -> dict:
    """Loader frames/s over a store of rendered frames vs the frames/s a PixelRSSM step consumes."""
    spec = DatasetSpec(name="bench-pixels", env_id="Pendulum-v1", policy="noisy_controller",
                       episodes=args.pixel_episodes, max_steps=args.max_steps,
                       episodes_per_shard=min(args.episodes_per_shard, args.pixel_episodes), seed=0, pixels=True,
                       pixel_size=args.pixel_size)
    url = os.path.join(tmp, "pixels.zarr")
    t0 = time.perf_counter()
    build_dataset(url, spec)
    build_s = time.perf_counter() - t0
    store = TrajectoryStore.open(url)
    loader = _loader_windows_per_s(store, args, store.obs_stats())
    demand = (args.pixel_demand if args.pixel_demand is not None
              else pixel_training_demand_frames_per_s(args.pixel_size, args.batch, args.window))
    frames = loader["windows_per_s"] * args.window
    return {"pixel_size": args.pixel_size, "build_s": build_s,
            "store_bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(url) for f in fs),
            "loader_frames_per_s": frames, "loader_first_batch_s": loader["first_batch_s"],
            "training_demand_frames_per_s": demand, "loader_vs_demand": frames / demand}


def _loader_windows_per_s(store: TrajectoryStore, args: Namespace, stats: dict) -> dict:
    """Best-of-repeats steady-state windows/s of a fresh loader (first batch, which decodes, timed apart)."""
    best, first_batch_s = 0.0, None
    for _ in range(args.repeats):
        sampler = GlobalWindowSampler(store.lengths, args.window, 1, args.batch, seed=0)
        start = time.perf_counter()
        with WindowLoader(store, sampler, rank=0, world_size=1, obs_stats=stats, prefetch=4) as loader:
            loader.next_batch()
            first = time.perf_counter() - start
            first_batch_s = first if first_batch_s is None else min(first_batch_s, first)
            start = time.perf_counter()
            windows = sum(len(loader.next_batch()["sample_index"]) for _ in range(args.batches))
            best = max(best, windows / (time.perf_counter() - start))
    return {"windows_per_s": best, "first_batch_s": first_batch_s}


class _MmapGather:
    """The baseline: raw arrays on disk, memory-mapped, gathered with one fancy index per array."""

    def __init__(self, store: TrajectoryStore, directory: str, stats: dict) -> None:
        data = store.read_episodes(0, store.num_episodes)
        self.arrays = {}
        for key in ("obs", "action", "reward", "terminated"):
            path = os.path.join(directory, f"{key}.npy")
            np.save(path, data[key])
            self.arrays[key] = np.load(path, mmap_mode="r")
        self.lengths = store.lengths.astype(np.int64)
        self.tmax = store.max_steps
        self.stats = {k: np.asarray(v, np.float32) for k, v in stats.items()}

    def batch(self, rows: np.ndarray, window: int) -> dict:
        ep, start = rows[:, 1], rows[:, 2]
        t = start[:, None] + np.arange(window)[None, :]
        mask = t < self.lengths[ep][:, None]
        t = np.minimum(t, self.tmax - 1)
        e = ep[:, None]
        maskf = mask.astype(np.float32)
        obs = (self.arrays["obs"][e, t] - self.stats["obs_mean"]) / self.stats["obs_std"]
        reward = (self.arrays["reward"][e, t] - self.stats["reward_mean"]) / self.stats["reward_std"]
        return {
            "obs": torch.from_numpy(np.ascontiguousarray(obs * maskf[:, :, None], dtype=np.float32)),
            "action": torch.from_numpy(np.ascontiguousarray(self.arrays["action"][e, t] * maskf[:, :, None])),
            "reward": torch.from_numpy(np.ascontiguousarray(reward * maskf, dtype=np.float32)),
            "terminated": torch.from_numpy((self.arrays["terminated"][e, t] & mask).astype(np.float32)),
            "mask": torch.from_numpy(maskf),
            "sample_index": torch.from_numpy(np.ascontiguousarray(rows[:, 0])),
        }


def _mmap_windows_per_s(gather: _MmapGather, store: TrajectoryStore, args: Namespace) -> float:
    best = 0.0
    for _ in range(args.repeats):
        sampler = GlobalWindowSampler(store.lengths, args.window, 1, args.batch, seed=0)
        gather.batch(sampler.next_global_batch(), args.window)
        start = time.perf_counter()
        windows = sum(
            len(gather.batch(sampler.next_global_batch(), args.window)["sample_index"])
            for _ in range(args.batches)
        )
        best = max(best, windows / (time.perf_counter() - start))
    return best


def run(args: Namespace | dict | None = None) -> dict:
    """Run the benchmark; returns (and writes to ``args.out`` when set) the result dict."""
    if args is None:
        args = parse_args([])
    elif isinstance(args, dict):
        args = SimpleNamespace(**{**vars(parse_args([])), **args})
    demand = (
        args.demand if args.demand is not None else training_demand_windows_per_s(args.batch, args.window)
    )
    result: dict = {
        "benchmark": "loader",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "training_demand_windows_per_s": demand,
        "targets": {"loader_vs_mmap": TARGET_VS_MMAP, "loader_vs_demand": TARGET_VS_DEMAND},
        "compressors": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        for compressor in ("none", "zstd"):
            spec = DatasetSpec(
                name=f"bench-{compressor}",
                env_id="Pendulum-v1",
                policy="noisy_controller",
                episodes=args.episodes,
                max_steps=args.max_steps,
                episodes_per_shard=args.episodes_per_shard,
                seed=0,
                compressor=compressor,
            )
            url = os.path.join(tmp, f"{compressor}.zarr")
            t0 = time.perf_counter()
            build_dataset(url, spec)
            build_s = time.perf_counter() - t0
            store = TrajectoryStore.open(url)
            stats = store.obs_stats()
            loader = _loader_windows_per_s(store, args, stats)
            mmap_dir = os.path.join(tmp, f"{compressor}-npy")
            os.makedirs(mmap_dir)
            mmap = _mmap_windows_per_s(_MmapGather(store, mmap_dir, stats), store, args)
            store_bytes = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(url) for f in files
            )
            result["compressors"][compressor] = {
                "build_s": build_s,
                "store_bytes": store_bytes,
                "loader_windows_per_s": loader["windows_per_s"],
                "loader_first_batch_s": loader["first_batch_s"],
                "mmap_windows_per_s": mmap,
                "loader_vs_mmap": loader["windows_per_s"] / mmap,
                "loader_vs_demand": loader["windows_per_s"] / demand,
                "training_loop_overhead": _training_overhead(store, args, stats),
            }
        if args.pixel_size:
            result["pixels"] = _pixel_rows(tmp, args)
    result["meets_targets"] = all(
        c["loader_vs_mmap"] >= TARGET_VS_MMAP and c["loader_vs_demand"] >= TARGET_VS_DEMAND
        for c in result["compressors"].values()
    )
    if getattr(args, "out", None):
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
            f.write("\n")
    return result


def _print(result: dict) -> None:
    print(
        f"training demand (tiny GRU fwd+bwd, 16x32): {result['training_demand_windows_per_s']:,.0f} windows/s"
    )
    for name, c in result["compressors"].items():
        print(
            f"[{name:>4}] loader {c['loader_windows_per_s']:>10,.0f} w/s | mmap {c['mmap_windows_per_s']:>10,.0f} w/s"
            f" | loader/mmap {c['loader_vs_mmap']:.2f} (target >= {TARGET_VS_MMAP})"
            f" | loader/demand {c['loader_vs_demand']:.1f} (target >= {TARGET_VS_DEMAND})"
            f" | first batch {c['loader_first_batch_s'] * 1e3:.1f} ms | store {c['store_bytes'] / 1e6:.2f} MB"
            f" | GRU loop slowdown when fed by loader {c['training_loop_overhead'] * 100:+.1f}%"
        )
    if "pixels" in result:
        p = result["pixels"]
        print(f"[pixels {p['pixel_size']}x{p['pixel_size']}] loader {p['loader_frames_per_s']:,.0f} frames/s | "
              f"PixelRSSM training demand {p['training_demand_frames_per_s']:,.0f} frames/s | "
              f"loader/demand {p['loader_vs_demand']:.1f}")
    print("meets targets:", result["meets_targets"])


def main(args: Namespace) -> int:
    """Run with the command line's options, print the result."""
    result = run(args)
    _print(result)
    print(f"wrote {args.out}")
    return 0


COMMAND = Benchmark("loader", __doc__, OPTIONS, main)

if __name__ == "__main__":
    COMMAND.script()

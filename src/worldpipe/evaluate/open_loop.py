"""Evaluate a trained world model by open-loop imagination on held-out episodes.

For every held-out segment of `context + horizon` steps the model filters `context` observations, then
imagines `horizon` steps from the recorded actions alone. Its error at each horizon is compared with the
"repeat the last observation" baseline; a ratio below 1 means the model predicts better than standing still.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from worldpipe.checkpoint import CheckpointManager, CheckpointNotFoundError
from worldpipe.core.atomic import write_atomic
from worldpipe.core.axes import legend_outside, readable_log_axis
from worldpipe.core.errors import UsageError
from worldpipe.core.figures import save_figure
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore
from worldpipe.models import WorldModel, flat_observations
from worldpipe.models.open_loop import predict_observations
from worldpipe.models.restore import restore_model

SAMPLED_SEED = 0  # the noise of the sampled open loop: fixed, so an evaluation repeats to the bit


def load_model(checkpoint_dir: str, step: int | None = None) -> tuple[WorldModel, dict]:
    """The model of a checkpoint (by default the newest loadable: the step training would resume from) and its
    identity record."""
    manager = CheckpointManager(checkpoint_dir)
    chosen = step if step is not None else manager.latest_loadable()
    if chosen is None:
        raise CheckpointNotFoundError(f"no loadable checkpoint in {checkpoint_dir}")
    state = manager.load(chosen)  # the state decoded while choosing, not read twice
    identity = state["identity"]
    return restore_model(identity["config"]["model"], state["model"], identity), {"step": chosen, **identity}


class SegmentLengthError(UsageError, ValueError):
    """Context plus horizon longer than every held-out episode (exit 2: a shorter one must be asked for)."""


def heldout_segments(episodes: dict[str, np.ndarray], length: int,
                     key: str = "obs") -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping fully valid segments of `length` steps: obs [N,length,O], action [N,length,A].

    ``key``: the array the model observes ("pixels": flat frames, O = H*W*3, raw 0..255 values).
    """
    observed = flat_observations(episodes, key)
    obs, actions = [], []
    for i, ep_len in enumerate(episodes["length"]):
        for start in range(0, int(ep_len) - length + 1, length):
            obs.append(observed[i, start : start + length])
            actions.append(episodes["action"][i, start : start + length])
    if not obs:
        raise SegmentLengthError(f"no held-out episode has {length} valid steps (context + horizon); lower "
                                 "--context/--horizon (a pipeline config's evaluate: context/horizon)")
    return np.stack(obs), np.stack(actions)


def segment_episodes(lengths: np.ndarray, length: int) -> np.ndarray:
    """The held-out episode of each segment :func:`heldout_segments` cuts, in its order: [N] int."""
    return np.asarray([i for i, ep_len in enumerate(lengths) for _ in range(0, int(ep_len) - length + 1, length)],
                      dtype=np.int64)


def evaluate(checkpoint_dir: str, store_url: str, manifest_path: str, context: int, horizon: int,
             predictions_out: str | Path | None = None, step: int | None = None) -> dict:
    """Per-horizon MSE of model and baseline (raw observation units) and their ratio.

    ``predictions_out``: also write the inputs and the predicted trajectories (npz: obs, action, predicted).
    ``step``: the checkpoint evaluated (default: the newest loadable).
    """
    manifest = load_manifest(manifest_path)
    store = TrajectoryStore.open(store_url, manifest=manifest)
    model, identity = load_model(checkpoint_dir, step)
    episodes = store.read_episodes(0, store.num_episodes)
    obs, action = heldout_segments(episodes, context + horizon, model.observation_key)
    obs_t, action_t = torch.from_numpy(obs), torch.from_numpy(action)  # [N,C+H,O], [N,C+H,A]
    predicted = predict_observations(model, obs_t, action_t, context)  # [N,H,O]
    if predictions_out is not None:
        write_predictions(predictions_out, obs, action, predicted.numpy(),
                          segment_episodes(episodes["length"], context + horizon))
    target = obs_t[:, context:]
    baseline = obs_t[:, context - 1 : context].expand_as(target)
    model_mse = (predicted - target).pow(2).mean(dim=(0, 2)).double().numpy()  # [H]
    baseline_mse = (baseline - target).pow(2).mean(dim=(0, 2)).double().numpy()
    ratio = model_mse / np.maximum(baseline_mse, 1e-12)
    sampled = sampled_metrics(model, obs_t, action_t, context, target, baseline_mse)
    extra = pixel_metrics(predicted, target, baseline) if model.observation_key == "pixels" else {}
    return {
        "model": type(model).__name__,
        "experiment": identity["config"].get("experiment_name"),
        "checkpoint_step": identity["step"],
        "mlflow_run_id": identity.get("mlflow_run_id"),
        "train_dataset_hash": identity["dataset_hash"],
        "heldout_dataset_hash": manifest["dataset_hash"],
        "segments": int(obs.shape[0]),
        "context": context,
        "horizon": horizon,
        "model_mse": model_mse.tolist(),
        "baseline_mse": baseline_mse.tolist(),
        "ratio": ratio.tolist(),
        "one_step_ratio": float(ratio[0]),
        "beats_baseline_one_step": bool(ratio[0] < 1.0),
        **sampled,
        **extra,
    }


def sampled_metrics(model: WorldModel, obs: torch.Tensor, action: torch.Tensor, context: int,
                    target: torch.Tensor, baseline_mse: np.ndarray) -> dict:
    """The same open loop with sampled latents (a stochastic model's imagination as a planner samples it), beside
    the means of :func:`evaluate`: ``sampled_model_mse`` and ``sampled_ratio`` per horizon. Empty for a model that
    draws no noise. The noise comes from a fixed seed, so the figures repeat."""
    shape = model.rollout_noise_shape()
    if shape is None:
        return {}
    generator = torch.Generator().manual_seed(SAMPLED_SEED)
    noise = torch.randn(obs.shape[0], target.shape[1], *shape, generator=generator)
    predicted = predict_observations(model, obs, action, context, noise)
    mse = (predicted - target).pow(2).mean(dim=(0, 2)).double().numpy()
    ratio = mse / np.maximum(baseline_mse, 1e-12)
    return {"sampled_model_mse": mse.tolist(), "sampled_ratio": ratio.tolist(),
            "sampled_one_step_ratio": float(ratio[0])}


def pixel_metrics(predicted: torch.Tensor, target: torch.Tensor, baseline: torch.Tensor) -> dict:
    """Per-horizon pixel MSE and PSNR (values in [0, 1]; predictions clipped to what a frame can show) of model
    and repeat-last-frame, their ratio, and whether the model beats the baseline at the first and last horizon."""
    def per_horizon(frames: torch.Tensor) -> np.ndarray:
        shown = frames.clamp(0.0, 255.0) / 255.0
        return (shown - target / 255.0).pow(2).mean(dim=(0, 2)).double().numpy()  # [H]

    model_mse, baseline_mse = per_horizon(predicted), per_horizon(baseline)
    ratio = model_mse / np.maximum(baseline_mse, 1e-12)
    return {
        "pixel_mse": model_mse.tolist(),
        "baseline_pixel_mse": baseline_mse.tolist(),
        "pixel_ratio": ratio.tolist(),
        "psnr": (10.0 * np.log10(1.0 / np.maximum(model_mse, 1e-12))).tolist(),
        "baseline_psnr": (10.0 * np.log10(1.0 / np.maximum(baseline_mse, 1e-12))).tolist(),
        "beats_baseline_first_and_last": bool(ratio[0] < 1.0 and ratio[-1] < 1.0),
    }


def write_predictions(path: str | Path, obs: np.ndarray, action: np.ndarray, predicted: np.ndarray,
                      episode: np.ndarray | None = None) -> None:
    """The held-out inputs, the open-loop predictions (and each segment's episode), atomically as one npz."""
    buffer = io.BytesIO()
    extra = {} if episode is None else {"episode": episode}
    np.savez(buffer, obs=obs, action=action, predicted=predicted, **extra)
    write_atomic(Path(path), buffer.getvalue())


def plot_error_vs_horizon(result: dict, path: str | Path) -> None:
    """Line plot of model and baseline MSE against imagination horizon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, result["horizon"] + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, result["model_mse"], marker="o", label=f"{result.get('model', 'model')} (open loop)")
    ax.plot(steps, result["baseline_mse"], marker="s", label="repeat last observation")
    ax.set_xlabel("horizon (steps)")
    ax.set_ylabel("MSE (raw observation units)")
    readable_log_axis(ax, "y", [*result["model_mse"], *result["baseline_mse"]])
    ax.set_title(f"Held-out error vs horizon (one-step ratio {result['one_step_ratio']:.3f})")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def plot_models_vs_baseline(results: dict[str, dict], path: str | Path) -> None:
    """Every experiment's model/baseline MSE ratio against horizon, on one plot (below 1 beats the baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, result in sorted(results.items()):
        steps = np.arange(1, result["horizon"] + 1)
        ax.plot(steps, result["ratio"], marker="o", label=f"{name} ({result.get('model', 'model')})")
    ax.axhline(1.0, color="grey", linestyle="--", label="repeat last observation")
    ax.set_xlabel("horizon (steps)")
    ax.set_ylabel("MSE ratio, model / baseline")
    readable_log_axis(ax, "y", [1.0, *(r for result in results.values() for r in result["ratio"])])
    ax.set_title("Held-out open-loop error relative to the baseline")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def plot_loss_curve(history: dict[str, list[tuple[int, float]]], path: str | Path) -> None:
    """Training loss terms by step (from the MLflow run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    values = []
    for key, points in sorted(history.items()):
        if points:
            steps, ys = zip(*points, strict=True)
            ax.plot(steps, ys, label=key)
            values.extend(ys)
    ax.set_xlabel("step")
    ax.set_ylabel("loss per valid step")
    # Log when every term is positive (labelled ticks in plain numbers); a term that can go negative (a Gaussian
    # log-likelihood) keeps the axis linear rather than folding it.
    readable_log_axis(ax, "y", values)
    ax.set_title("Training loss")
    legend_outside(ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=100, bbox_inches="tight")

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
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore
from worldpipe.models import WorldModel
from worldpipe.models.open_loop import predict_observations
from worldpipe.models.restore import restore_model


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


def heldout_segments(episodes: dict[str, np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping fully valid segments of `length` steps: obs [N,length,O], action [N,length,A]."""
    obs, actions = [], []
    for i, ep_len in enumerate(episodes["length"]):
        for start in range(0, int(ep_len) - length + 1, length):
            obs.append(episodes["obs"][i, start : start + length])
            actions.append(episodes["action"][i, start : start + length])
    if not obs:
        raise ValueError(f"no held-out episode has {length} valid steps; lower evaluate context/horizon")
    return np.stack(obs), np.stack(actions)


def evaluate(checkpoint_dir: str, store_url: str, manifest_path: str, context: int, horizon: int,
             predictions_out: str | Path | None = None) -> dict:
    """Per-horizon MSE of model and baseline (raw observation units) and their ratio.

    ``predictions_out``: also write the inputs and the predicted trajectories (npz: obs, action, predicted).
    """
    manifest = load_manifest(manifest_path)
    store = TrajectoryStore.open(store_url, manifest=manifest)
    model, identity = load_model(checkpoint_dir)
    obs, action = heldout_segments(store.read_episodes(0, store.num_episodes), context + horizon)
    obs_t, action_t = torch.from_numpy(obs), torch.from_numpy(action)  # [N,C+H,O], [N,C+H,A]
    predicted = predict_observations(model, obs_t, action_t, context)  # [N,H,O]
    if predictions_out is not None:
        write_predictions(predictions_out, obs, action, predicted.numpy())
    target = obs_t[:, context:]
    baseline = obs_t[:, context - 1 : context].expand_as(target)
    model_mse = (predicted - target).pow(2).mean(dim=(0, 2)).double().numpy()  # [H]
    baseline_mse = (baseline - target).pow(2).mean(dim=(0, 2)).double().numpy()
    ratio = model_mse / np.maximum(baseline_mse, 1e-12)
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
    }


def write_predictions(path: str | Path, obs: np.ndarray, action: np.ndarray, predicted: np.ndarray) -> None:
    """The held-out inputs and the open-loop predictions, published atomically as one npz file."""
    buffer = io.BytesIO()
    np.savez(buffer, obs=obs, action=action, predicted=predicted)
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
    ax.set_yscale("log")
    ax.set_title(f"Held-out error vs horizon (one-step ratio {result['one_step_ratio']:.3f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    ax.set_yscale("log")
    ax.set_title("Held-out open-loop error relative to the baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_loss_curve(history: dict[str, list[tuple[int, float]]], path: str | Path) -> None:
    """Training loss terms by step (from the MLflow run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, points in sorted(history.items()):
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss per valid step")
    ax.set_yscale("symlog")
    ax.set_title("Training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Pictures of what a model imagines on held-out episodes, drawn from an evaluation's predictions file.

Frame models (``observation_key == "pixels"``): per held-out episode a frame grid (rows: true, imagined,
absolute error; columns: horizon) as PNG and an animated GIF of the true frames beside the imagined ones.
State models: per held-out episode the true trajectory against the imagined mean and a band (min..max) over
several stochastic imaginations, one panel per state dimension.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from worldpipe.core.atomic import write_atomic
from worldpipe.models import WorldModel

EPISODES_DRAWN = 4  # held-out episodes pictured (the first segment of each)
STATE_SAMPLES = 8  # stochastic imaginations behind a state model's band
_SCALE = 2  # frame pixels per picture pixel side: 64x64 frames are small on screen
_GAP = 2


def to_frames(flat: np.ndarray, size: int) -> np.ndarray:
    """Flat raw frames [..., size*size*3] (any float) as uint8 images [..., size, size, 3] (clipped)."""
    return np.clip(np.rint(flat), 0, 255).astype(np.uint8).reshape(*flat.shape[:-1], size, size, 3)


def _save_png(image: np.ndarray, path: Path) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    write_atomic(path, buffer.getvalue())


def frame_grid(true: np.ndarray, imagined: np.ndarray) -> np.ndarray:
    """One image: rows true / imagined / |error|, columns horizon; true and imagined uint8 [H, S, S, 3]."""
    error = np.abs(true.astype(np.int16) - imagined.astype(np.int16)).astype(np.uint8)
    horizon, size = true.shape[0], true.shape[1] * _SCALE
    cell = size + _GAP
    grid = np.full((3 * cell + _GAP, horizon * cell + _GAP, 3), 255, np.uint8)
    for row, frames in enumerate((true, imagined, 255 - error)):  # error dark on white, like the frames
        for col in range(horizon):
            big = frames[col].repeat(_SCALE, 0).repeat(_SCALE, 1)
            y, x = _GAP + row * cell, _GAP + col * cell
            grid[y:y + size, x:x + size] = big
    return grid


def side_by_side_gif(true: np.ndarray, imagined: np.ndarray) -> bytes:
    """An animated GIF (one frame per horizon step): the true frame left, the imagined frame right."""
    from PIL import Image

    pairs = [np.concatenate([t, np.full((t.shape[0], _GAP, 3), 255, np.uint8), i], axis=1)
             for t, i in zip(true, imagined, strict=True)]
    images = [Image.fromarray(p.repeat(3, 0).repeat(3, 1)) for p in pairs]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=200, loop=0)
    return buffer.getvalue()


def first_segments(episode: np.ndarray, limit: int = EPISODES_DRAWN) -> list[int]:
    """Indices of the first segment of each of the first ``limit`` held-out episodes (segment -> episode map)."""
    firsts = [i for i in range(len(episode)) if i == 0 or episode[i] != episode[i - 1]]
    return firsts[:limit]


def write_frame_pictures(model: WorldModel, predictions: dict, context: int, out_dir: Path) -> list[Path]:
    """Frame grid PNG and true-beside-imagined GIF per pictured held-out episode; the files written."""
    size = model.image_size
    name, written = type(model).__name__, []
    for index in first_segments(predictions["episode"]):
        true = to_frames(predictions["obs"][index, context:], size)
        imagined = to_frames(predictions["predicted"][index], size)
        episode = int(predictions["episode"][index])
        grid = out_dir / f"{name}-frames-ep{episode}.png"
        _save_png(frame_grid(true, imagined), grid)
        gif = out_dir / f"{name}-imagined-ep{episode}.gif"
        write_atomic(gif, side_by_side_gif(true, imagined))
        written += [grid, gif]
    return written


@torch.no_grad()
def sample_imaginations(model: WorldModel, obs: torch.Tensor, action: torch.Tensor, context: int,
                        samples: int, seed: int = 0) -> torch.Tensor:
    """``samples`` stochastic open-loop imaginations (raw units) of one segment: [samples, T-context, O].

    Deterministic models (no rollout noise) give the same trajectory each time: a band of zero width.
    """
    normalized = ((obs - model.obs_mean) / model.obs_std).expand(samples, *obs.shape[1:])
    actions = action.expand(samples, *action.shape[1:])
    state = model.observe_context(normalized[:, :context], actions[:, :context])
    shape, generator = model.rollout_noise_shape(), torch.Generator().manual_seed(seed)
    out = []
    for t in range(context, obs.shape[1]):
        noise = None if shape is None else torch.randn(samples, *shape, generator=generator)
        predicted, _, state = model.imagine_step(state, actions[:, t - 1], noise)
        out.append(predicted * model.obs_std + model.obs_mean)
    return torch.stack(out, dim=1)


def write_state_pictures(model: WorldModel, predictions: dict, context: int, out_dir: Path) -> list[Path]:
    """True vs imagined trajectories per state dimension with a band over stochastic samples, per episode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, written = type(model).__name__, []
    for index in first_segments(predictions["episode"]):
        obs = torch.from_numpy(predictions["obs"][index:index + 1])
        action = torch.from_numpy(predictions["action"][index:index + 1])
        draws = sample_imaginations(model, obs, action, context, STATE_SAMPLES).numpy()
        true, mean = predictions["obs"][index], predictions["predicted"][index]
        steps, imagined_steps = np.arange(true.shape[0]), np.arange(context, true.shape[0])
        dims = true.shape[1]
        fig, axes = plt.subplots(dims, 1, figsize=(6, 1.8 * dims), sharex=True, squeeze=False)
        for d, ax in enumerate(axes[:, 0]):
            ax.plot(steps, true[:, d], color="black", label="true")
            ax.plot(imagined_steps, mean[:, d], color="tab:blue", label="imagined (mean)")
            ax.fill_between(imagined_steps, draws[:, :, d].min(0), draws[:, :, d].max(0), color="tab:blue",
                            alpha=0.25, label=f"{STATE_SAMPLES} samples (min..max)")
            ax.axvline(context - 0.5, color="grey", linestyle=":")
            ax.set_ylabel(f"obs[{d}]")
        axes[0, 0].legend(fontsize="small", loc="upper right")
        axes[-1, 0].set_xlabel("step (dotted line: end of the context)")
        episode = int(predictions["episode"][index])
        fig.suptitle(f"{name}: held-out episode {episode}")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90)
        plt.close(fig)
        path = out_dir / f"{name}-trajectories-ep{episode}.png"
        write_atomic(path, buffer.getvalue())
        written.append(path)
    return written


def write_pictures(model: WorldModel, predictions_path: str | Path, context: int, out_dir: str | Path) -> list[Path]:
    """The pictures of an evaluation (frames for frame models, trajectory bands for state models)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with np.load(predictions_path) as arrays:
        predictions = {key: arrays[key] for key in arrays.files}
    if model.observation_key == "pixels":
        return write_frame_pictures(model, predictions, context, out)
    return write_state_pictures(model, predictions, context, out)

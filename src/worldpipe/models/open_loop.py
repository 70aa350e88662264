"""Open-loop prediction in raw observation units: the one definition evaluation and the served model share."""

from __future__ import annotations

import torch

from worldpipe.models.base import WorldModel


def predict_observations(model: WorldModel, obs: torch.Tensor, action: torch.Tensor, context: int,
                         noise: torch.Tensor | None = None) -> torch.Tensor:
    """Filter ``context`` observed steps, imagine the rest from the actions: [N,T-context,O] in raw units; with
    means, or with sampled latents drawn from ``noise`` (see :meth:`WorldModel.predict_open_loop`).

    obs [N,T,O] and action [N,T,A] are raw (unnormalized); only ``obs[:, :context]`` and ``action[:, :T-1]``
    are read, so the observations after the context may be anything (e.g. zeros).
    """
    normalized = (obs - model.obs_mean) / model.obs_std
    return model.predict_open_loop(normalized, action, context, noise) * model.obs_std + model.obs_mean

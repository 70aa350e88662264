"""World models as plugins: ``conf/model/*.yaml`` names the class (``_target_``), :func:`build_model` builds it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel, state_nbytes


class ModelConfigError(ValueError):
    """A model config that cannot be instantiated; the message names the key."""


def build_model(model_cfg: Mapping[str, Any], obs_dim: int, act_dim: int) -> WorldModel:
    """Instantiate the model a config names (``_target_`` plus its keyword arguments) for these sizes."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    cfg = model_cfg if isinstance(model_cfg, DictConfig) else OmegaConf.create(dict(model_cfg))
    if "_target_" not in cfg:
        raise ModelConfigError("config key 'model._target_': missing (the model class to build)")
    try:
        model = instantiate(cfg, obs_dim=obs_dim, act_dim=act_dim, _convert_="all")
    except InstantiationException as err:
        raise ModelConfigError(f"config key 'model': cannot build {cfg._target_}: {err}") from err
    if not isinstance(model, WorldModel):
        raise ModelConfigError(f"config key 'model._target_': {cfg._target_} is not a worldpipe WorldModel")
    return model


__all__ = ["ModelConfigError", "ParallelSupport", "RolloutState", "WorldModel", "build_model", "state_nbytes"]

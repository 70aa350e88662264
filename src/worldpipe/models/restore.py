"""A trained model back from its weights: the one place that turns (model config, dims, weights) into a model.

The trainer records the dimensions a model was built with (``identity["dims"]``); for checkpoints written
before it did, they are inferred from the weights. Pure torch: the caller reads the checkpoint or artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldpipe.models import build_model
from worldpipe.models.base import WorldModel

DIMS_KEY = "dims"  # identity["dims"] = {"obs_dim": ..., "act_dim": ...}, written by the trainer


def model_dims_record(obs_dim: int, act_dim: int) -> dict[str, int]:
    """The dimensions record a trainer stores beside a model so it can be rebuilt from its weights."""
    return {"obs_dim": int(obs_dim), "act_dim": int(act_dim)}


def model_dims(identity: Mapping[str, Any], model_state: Mapping[str, Any], model_cfg: Any) -> tuple[int, int]:
    """(obs_dim, act_dim) of a checkpoint's model.

    Recorded dims (``identity["dims"]``) win. Otherwise obs_dim is the length of the ``obs_mean`` buffer every
    WorldModel has, and act_dim is solved from the parameter shapes: built with act_dim 1 and 2, some
    parameter's shape changes linearly with it.
    """
    dims = identity.get(DIMS_KEY) or {}
    if "obs_dim" in dims and "act_dim" in dims:
        return int(dims["obs_dim"]), int(dims["act_dim"])
    obs_dim = int(model_state["obs_mean"].shape[0])
    one = build_model(model_cfg, obs_dim, 1).state_dict()
    two = build_model(model_cfg, obs_dim, 2).state_dict()
    for name, tensor in model_state.items():
        a, b = one.get(name), two.get(name)
        if a is None or b is None or a.shape == b.shape:
            continue
        for axis, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)):
            if x != y:
                return obs_dim, 1 + (int(tensor.shape[axis]) - x) // (y - x)
    raise ValueError("checkpoint identity has no 'dims' and no parameter depends on the action size")


def restore_model(model_cfg: Any, model_state: Mapping[str, Any], identity: Mapping[str, Any]) -> WorldModel:
    """Build the model ``model_cfg`` names with the recorded (or inferred) dims, load its weights, eval mode."""
    obs_dim, act_dim = model_dims(identity, model_state, model_cfg)
    model = build_model(model_cfg, obs_dim, act_dim)
    model.load_state_dict(model_state)
    return model.eval()

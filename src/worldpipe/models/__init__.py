"""World models as plugins: ``conf/model/*.yaml`` names the class (``_target_``), :func:`build_model` builds it."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from typing import Any

from worldpipe.core.errors import UsageError
from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel, flat_observations, state_nbytes


class ModelConfigError(UsageError, ValueError):
    """A model config that cannot be instantiated; the message names the key."""


def observation_key(model_cfg: Mapping[str, Any]) -> str:
    """The stored array the model a config names observes ("obs" or "pixels"), known before it is built."""
    from hydra.utils import get_class

    try:
        cls = get_class(str(model_cfg["_target_"]))
    except Exception as err:  # noqa: BLE001 - any import failure is the config's problem to report
        raise ModelConfigError(f"config key 'model._target_': cannot import {model_cfg.get('_target_')!r} ({err})") from None
    return getattr(cls, "observation_key", "obs")


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


_SIMPLE_TYPES = (bool, int, float, str)


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def check_model_config(model_cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, problem) pairs of a model config checked against its class's constructor signature.

    The signature is the model's schema: every key must be a parameter, and plain-typed parameters (bool, int,
    float, str) must get a value of that type; the sizes the class declares (``WorldModel.dimensions``) must be
    positive integers, and a wrapper's inner model config (``WorldModel.submodels``) is checked the same way.
    Checked before any process starts.
    """

    from hydra.utils import get_class

    target = model_cfg.get("_target_")
    if not target:
        return [("model._target_", "missing (the model class to build)")]
    try:
        cls = get_class(str(target))
    except Exception as err:  # noqa: BLE001 - any import failure is the config's problem to report
        return [("model._target_", f"cannot import {target!r} ({err})")]
    if not (isinstance(cls, type) and issubclass(cls, WorldModel)):
        return [("model._target_", f"{target} is not a worldpipe WorldModel")]
    params = inspect.signature(cls.__init__).parameters
    hints = typing.get_type_hints(cls.__init__)
    problems = []
    for key, value in model_cfg.items():
        if str(key).startswith("_"):
            continue
        if key not in params or key in ("self", "obs_dim", "act_dim"):
            problems.append((f"model.{key}", f"{cls.__name__} takes no parameter {key!r}"))
        elif hints.get(key) in _SIMPLE_TYPES and not _fits(value, hints[key]):
            problems.append((f"model.{key}", f"must be {hints[key].__name__}, got {value!r}"))
    return problems or _dimension_problems(cls, model_cfg, params)


def _dimension_problems(cls: type[WorldModel], model_cfg: Mapping[str, Any], params) -> list[tuple[str, str]]:
    """The sizes a model class declares (``dimensions``) are positive integers; its submodels check out too."""
    problems = []
    for key in cls.dimensions:
        value = model_cfg.get(key, params[key].default if key in params else None)
        if not _fits(value, int) or value < 1:
            problems.append((f"model.{key}", f"must be a positive integer (a size of {cls.__name__}), got {value!r}"))
    for key in cls.submodels:
        inner = model_cfg.get(key)
        if not isinstance(inner, Mapping):
            problems.append((f"model.{key}", f"must be a model config (_target_ and its arguments), got {inner!r}"))
            continue
        problems += [(name.replace("model.", f"model.{key}.", 1), problem)
                     for name, problem in check_model_config(inner)]
    return problems


__all__ = ["ModelConfigError", "ParallelSupport", "RolloutState", "WorldModel", "build_model", "check_model_config",
           "flat_observations", "observation_key", "state_nbytes"]

"""The settings of a planner's terminal value: what the pipeline config's ``value:`` says, checked and written out.

A planner that looks ``horizon`` steps ahead cannot see a reward further away; a value estimate of the state its
imagined sequence ends in stands for the rest of the episode (TD-MPC's and MuZero's shape). The estimate is fitted
through the learned model itself (:mod:`worldpipe.control.value`), so it needs no other training job; these
settings say how. Recorded in full (defaults written out) wherever they are part of an identity: a collected
dataset's spec (``collector.value``) and a closed-loop evaluation's settings, so a later change of a default
cannot change what an old address means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ValueSettings:
    """Fitted value iteration through the model, on states of its own training data."""

    iterations: int = 6      # backups: each looks one planner horizon further ahead
    states: int = 4096       # training-data states the value is fitted on (evenly strided valid steps)
    candidates: int = 16     # random action sequences per state and backup; the best one's return is the target
    fit_steps: int = 300     # Adam steps per backup on the whole batch of states
    hidden: int = 128        # width of the value network's two hidden layers
    learning_rate: float = 1e-3


POSITIVE_INTEGERS = ("iterations", "states", "candidates", "fit_steps", "hidden")


def value_settings(block: Any, where: str) -> dict[str, Any]:
    """``block`` (a mapping of some settings, the rest default) as the full settings dict; ValueError naming
    ``where`` (the config key) and the setting that is wrong."""
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be a mapping of value settings, got {block!r}")
    known = {field.name for field in dataclasses.fields(ValueSettings)}
    unknown = sorted(str(key) for key in block if key not in known)
    if unknown:
        raise ValueError(f"{where}: unknown setting {unknown[0]!r} (settings: {', '.join(sorted(known))})")
    for key in POSITIVE_INTEGERS:
        value = block.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{key} must be an integer >= 1, got {value!r}")
    rate = block.get("learning_rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ValueError(f"{where}.learning_rate must be a number > 0, got {rate!r}")
    settings = dataclasses.asdict(ValueSettings(**block))
    settings["learning_rate"] = float(settings["learning_rate"])
    return settings

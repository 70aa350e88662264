"""The settings of a planner's terminal value: what the pipeline config's ``value:`` says, checked and written out.

A planner that looks ``horizon`` steps ahead cannot see a reward further away; a value estimate of the state its
imagined sequence ends in stands for the rest of the episode (TD-MPC's and MuZero's shape). The estimate is fitted
through the learned model itself (:mod:`worldpipe.control.value`), so it needs no other training job; these
settings say how. Two methods:

* ``shooting`` (the default): fitted value iteration, each backup the best of a few random action sequences;
* ``actor_critic``: an actor and a critic trained together in imagination (Dreamer's shape): the actor's actions
  are improved through the model's gradients, so the value is that of a policy that learns, not of random actions.

Recorded in full (the method's defaults written out) wherever they are part of an identity: a collected dataset's
spec (``collector.value``) and a closed-loop evaluation's settings, so a later change of a default cannot change
what an old address means. The shooting settings are written without a ``method`` key, as they were before there
was a second method, so those addresses keep their hashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ValueSettings:
    """Fitted value iteration through the model, on states of its own training data (method ``shooting``)."""

    iterations: int = 6      # backups: each looks one planner horizon further ahead
    states: int = 4096       # training-data states the value is fitted on (evenly strided valid steps)
    candidates: int = 16     # random action sequences per state and backup; the best one's return is the target
    fit_steps: int = 300     # Adam steps per backup on the whole batch of states
    hidden: int = 128        # width of the value network's two hidden layers
    learning_rate: float = 1e-3


@dataclasses.dataclass(frozen=True)
class ActorCriticSettings:
    """An actor and a critic trained in imagination from states of the model's training data (``actor_critic``).

    Each of ``fit_steps`` updates imagines the planner's horizon from ``batch`` of the ``states`` with the actor's
    actions (plus Gaussian noise of ``actor_noise`` half-widths of the action box), computes TD(``td_lambda``)
    returns bootstrapped from a slowly updated copy of the critic (``target_update`` per step), regresses the
    critic onto them and moves the actor up their gradient through the model.
    """

    method: str = "actor_critic"
    states: int = 4096
    fit_steps: int = 2000
    batch: int = 256
    hidden: int = 128
    learning_rate: float = 1e-3         # the critic's Adam step
    actor_learning_rate: float = 3e-4
    td_lambda: float = 0.95
    actor_noise: float = 0.3
    target_update: float = 0.02


METHODS = {"shooting": ValueSettings, "actor_critic": ActorCriticSettings}
POSITIVE_INTEGERS = ("iterations", "states", "candidates", "fit_steps", "hidden", "batch")
# (name, lowest, lowest allowed, highest, highest allowed)
NUMBERS = (("learning_rate", 0.0, False, None, False), ("actor_learning_rate", 0.0, False, None, False),
           ("td_lambda", 0.0, True, 1.0, True), ("actor_noise", 0.0, True, None, False),
           ("target_update", 0.0, False, 1.0, True))


def _number_problem(rate: Any, low: float, low_ok: bool, high: float | None, high_ok: bool) -> str | None:
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        return "a number"
    if rate < low or (rate == low and not low_ok) or (high is not None and (rate > high or (rate == high and not high_ok))):
        bounds = f"{'>=' if low_ok else '>'} {low:g}" + ("" if high is None else f" and {'<=' if high_ok else '<'} {high:g}")
        return f"a number {bounds}"
    return None


def value_settings(block: Any, where: str) -> dict[str, Any]:
    """``block`` (a mapping of some settings, the rest default) as the full settings dict of its method;
    ValueError naming ``where`` (the config key) and the setting that is wrong."""
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be a mapping of value settings, got {block!r}")
    method = block.get("method", "shooting")
    if method not in METHODS:
        raise ValueError(f"{where}.method must be one of {', '.join(sorted(METHODS))}, got {method!r}")
    known = {field.name for field in dataclasses.fields(METHODS[method])} | {"method"}
    unknown = sorted(str(key) for key in block if key not in known)
    if unknown:
        raise ValueError(f"{where}: {unknown[0]!r} is not a setting of method {method!r} (its settings: "
                         f"{', '.join(sorted(known))})")
    for key in POSITIVE_INTEGERS:
        value = block.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{key} must be an integer >= 1, got {value!r}")
    for key, *bounds in NUMBERS:
        if key in block and (problem := _number_problem(block[key], *bounds)):
            raise ValueError(f"{where}.{key} must be {problem}, got {block[key]!r}")
    fields = {key: value for key, value in block.items() if key != "method"}
    settings = dataclasses.asdict(METHODS[method](**fields))
    for key, *_ in NUMBERS:
        if key in settings:
            settings[key] = float(settings[key])
    return settings

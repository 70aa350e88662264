"""What a closed-loop evaluation is asked to run, checked against the run it evaluates before anything runs.

The environment and behaviour policy default to the ones the run's training data recorded (its dataset manifest's
spec, as the pipeline passes them); a value given that disagrees with the record is refused, as is an environment
whose observation and action widths are not the model's, one the project has no true simulator for (the ceiling),
a policy the environment does not have, and counts that cannot work. Each refusal is one line naming the option,
what is wrong and what would work (:class:`ControlSettingsError`, exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from worldpipe.control.dynamics import TRUE_SIMULATORS, ControlError
from worldpipe.core.errors import UsageError
from worldpipe.data.environments import env_dims
from worldpipe.data.manifest import load_manifest
from worldpipe.data.policies import policies_for
from worldpipe.models import observation_key
from worldpipe.models.restore import DIMS_KEY


class ControlSettingsError(ControlError, UsageError):
    """A closed-loop evaluation's option that cannot work with this run or environment (exit 2)."""


@dataclass(frozen=True)
class RecordedEnv:
    """The environment and behaviour policy a run's training data was collected in, and where that is recorded."""

    env_id: str | None
    policy: str | None
    source: str
    # How the data's env was made beyond its id (DeepMind Control: action repeat, observation key order).
    env_options: dict | None = None


def recorded_env(identity: Mapping[str, Any]) -> RecordedEnv:
    """The env and policy of the dataset a checkpoint's run trained on (its ``data.manifest``'s spec); None for
    each where the checkpoint records no readable manifest."""
    manifest = ((identity.get("config") or {}).get("data") or {}).get("manifest")
    if not isinstance(manifest, str) or not manifest:
        return RecordedEnv(None, None, "the checkpoint records no dataset manifest")
    try:
        spec = load_manifest(manifest)["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        return RecordedEnv(None, None, f"its dataset manifest {manifest} cannot be read")
    options = {"action_repeat": int(spec.get("action_repeat", 1)), "observation_keys": spec.get("observation_keys")}
    return RecordedEnv(spec.get("env_id"), spec.get("policy"), f"its dataset manifest {manifest}", options)


def settled_env(env_id: str | None, policy: str | None, recorded: RecordedEnv) -> tuple[str, str]:
    """(env id, behaviour policy): the options given, else the recorded ones; a given one that disagrees with the
    record, or one neither gives, is refused naming the option."""
    chosen = []
    for option, given, known in (("--env-id", env_id, recorded.env_id),
                                 ("--behaviour-policy", policy, recorded.policy)):
        if given is not None and known is not None and given != known:
            raise ControlSettingsError(f"{option} {given}: the run was trained on data of {option.lstrip('-')} "
                                       f"{known} ({recorded.source}); leave {option} out to use it")
        if given is None and known is None:
            raise ControlSettingsError(f"{option} is needed: {recorded.source}; give the one the run's training "
                                       "data was collected with")
        chosen.append(given if given is not None else known)
    return chosen[0], chosen[1]


def check_counts(max_steps: int, episodes: int, context: int, http_episodes: int) -> None:
    """Episode length, episodes, context and HTTP episodes are counts that can work."""
    for option, value, least in (("--max-steps", max_steps, 1), ("--episodes", episodes, 1),
                                 ("--context", context, 1), ("--http-episodes", http_episodes, 0)):
        if value < least:
            raise ControlSettingsError(f"{option} {value}: must be >= {least}")


def check_env(env_id: str, policy: str, identity: Mapping[str, Any]) -> None:
    """The environment exists, has the model's observation and action widths, has a true simulator (the
    ceiling), and has the behaviour policy."""
    supported = ", ".join(TRUE_SIMULATORS)
    try:
        dims = env_dims(env_id)
    except gym.error.Error as err:
        raise ControlSettingsError(f"--env-id {env_id}: no such Gymnasium environment ({type(err).__name__}); "
                                   f"closed-loop evaluation runs in {supported}") from None
    _check_model_fits(env_id, dims, identity)
    if env_id not in TRUE_SIMULATORS:
        raise ControlSettingsError(f"--env-id {env_id}: closed-loop evaluation runs in {supported} only (the "
                                   "ceiling plans with a true simulator of the environment)")
    known = policies_for(env_id)
    if policy not in known:
        raise ControlSettingsError(f"--behaviour-policy {policy}: {env_id} has no such policy; policies: "
                                   f"{', '.join(known)}")


def _check_model_fits(env_id: str, dims, identity: Mapping[str, Any]) -> None:
    """The model acts with the env's action width and (a state model) observes its observation width."""
    recorded = identity.get(DIMS_KEY) or {}
    if "obs_dim" not in recorded or "act_dim" not in recorded:
        return  # an older checkpoint: its widths are known only once the model is loaded
    model_cfg = (identity.get("config") or {}).get("model") or {}
    state_model = not model_cfg or observation_key(model_cfg) != "pixels"
    widths = [("actions", int(recorded["act_dim"]), dims.act_dim)]
    if state_model:
        widths.insert(0, ("observations", int(recorded["obs_dim"]), dims.obs_dim))
    wrong = [f"{what} of {env} values, the model's of {model}" for what, model, env in widths if model != env]
    if wrong:
        raise ControlSettingsError(f"--env-id {env_id}: {' and '.join(wrong)}: the model was trained on another "
                                   "environment; give the one its training data was collected in")

"""A terminal value for the planner, fitted through the learned model: what lies past the planner's horizon.

A planner scores a candidate by the rewards it imagines over ``horizon`` steps. Where the reward is sparse and far
(DeepMind Control's pendulum-swingup pays only with the pole upright, several swings away from hanging), every
candidate from the bottom imagines zero and the planner has nothing to climb; a planner with a perfect simulator
fails the same way (its ceiling there is about 190 of 1,000). A value estimate of the state a candidate ends in
stands for the rest of the episode: the planner then maximises ``sum_t discount^t r_t + discount^H V(s_H)``, as
TD-MPC's does.

The value is fitted by fitted value iteration through the model on states of its own training data, with no other
training job: each backup imagines ``candidates`` random action sequences of the planner's horizon from every
state, takes the best one's discounted imagined rewards plus the discounted value (so far) of where it ends, and
regresses the value network onto those targets. Each backup looks one horizon further ahead; after ``iterations``
backups the value sees ``iterations`` horizons past the planner's own. Everything is seeded from the run's seed and
runs on one thread, so the value, and every decision planned with it, is a function of the checkpoint, the
training data and the settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldpipe.control.dynamics import ControlError
from worldpipe.control.planners import Planner
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore
from worldpipe.models import WorldModel
from worldpipe.rollout.engine import imagine_sequences

# States imagined together in one backup (candidates each): bounds memory, not the result.
CHUNK_STATES = 256


class TerminalValue(torch.nn.Module):
    """V(observation): an MLP on the model's normalised observation, in units of the env's return."""

    def __init__(self, model: WorldModel, hidden: int) -> None:
        super().__init__()
        self.register_buffer("obs_mean", model.obs_mean.reshape(-1).clone())
        self.register_buffer("obs_std", model.obs_std.reshape(-1).clone())
        width = self.obs_mean.numel()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ELU(), torch.nn.Linear(hidden, 1))

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        """Values [...] of raw observations [...,O]."""
        return self.net((observations - self.obs_mean) / self.obs_std).squeeze(-1)


def training_windows(store: TrajectoryStore, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` (or all, if fewer) context windows of ``store``, evenly strided over the valid steps that have
    ``context`` observations behind them: raw observations [B,C,O] and the actions between them, padded with the
    zero placeholder for the action about to be chosen [B,C,A] (as :class:`LearnedDynamics` observes)."""
    arrays = store.read_episodes(0, store.num_episodes)
    ends = [(i, p) for i, n in enumerate(arrays["length"]) for p in range(context - 1, int(n))]
    if not ends:
        raise ControlError(f"no training episode holds {context} steps: no state to fit the value on")
    picked = np.unique(np.linspace(0, len(ends) - 1, num=min(count, len(ends))).round().astype(np.int64))
    obs, actions = [], []
    for k in picked:
        episode, end = ends[k]
        obs.append(arrays["obs"][episode, end - context + 1:end + 1])
        taken = arrays["action"][episode, end - context + 1:end]
        actions.append(np.concatenate([taken, np.zeros((1, taken.shape[1]), taken.dtype)]))
    return (torch.from_numpy(np.stack(obs).astype(np.float32)),
            torch.from_numpy(np.stack(actions).astype(np.float32)))


def open_training_data(config: dict[str, Any]) -> TrajectoryStore:
    """The store a run trained on, from its recorded config; ControlError where it is not here."""
    data = config.get("data") or {}
    store, manifest = str(data.get("store", "")), str(data.get("manifest", ""))
    if not Path(manifest).is_file():
        raise ControlError(f"the value is fitted on the run's training data, and its manifest {manifest!r} is not "
                           "here (data.manifest of the run's config)")
    return TrajectoryStore.open(store, load_manifest(manifest))


def fit_value(model: WorldModel, windows: tuple[torch.Tensor, torch.Tensor], settings: dict[str, Any],
              horizon: int, discount: float, action_box: tuple[float, float], seed: int) -> TerminalValue:
    """The terminal value of ``model`` fitted on the states of ``windows`` (:func:`training_windows`) by
    ``settings['iterations']`` backups of ``horizon`` imagined steps (:mod:`worldpipe.config.value`)."""
    obs, actions = windows
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        value = TerminalValue(model, int(settings["hidden"]))
    with torch.no_grad():
        start = model.observe_context((obs - model.obs_mean) / model.obs_std, actions)
    now = obs[:, -1]
    low, high = action_box
    discounts = discount ** torch.arange(horizon, dtype=torch.float32)
    candidates = int(settings["candidates"])
    for backup in range(int(settings["iterations"])):
        targets = []
        with torch.no_grad():
            for first in range(0, now.shape[0], CHUNK_STATES):
                rows = slice(first, first + CHUNK_STATES)
                states = {key: part[rows].repeat_interleave(candidates, dim=0) for key, part in start.items()}
                count = now[rows].shape[0]
                sequences = low + (high - low) * torch.rand(count * candidates, horizon, model.act_dim,
                                                            generator=generator)
                imagined, rewards = imagine_sequences(model, states, sequences)
                backed_up = (rewards * discounts).sum(dim=1)
                if backup > 0:  # the first backup starts from V = 0: the best imagined horizon alone
                    backed_up = backed_up + discount**horizon * value(imagined[:, -1])
                targets.append(backed_up.view(count, candidates).max(dim=1).values)
        target = torch.cat(targets)
        optimizer = torch.optim.Adam(value.parameters(), lr=float(settings["learning_rate"]))
        for _ in range(int(settings["fit_steps"])):
            loss = (value(now) - target).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return value.eval().requires_grad_(False)


def fitted_value(model: WorldModel, config: dict[str, Any], settings: dict[str, Any], planner: Planner,
                 context: int, action_box: tuple[float, float]) -> TerminalValue:
    """The terminal value a planner uses with ``model``: fitted on the training data of the run whose recorded
    config is ``config``, over ``planner``'s horizon and discount, seeded from the run's seed."""
    windows = training_windows(open_training_data(config), int(settings["states"]), context)
    return fit_value(model, windows, settings, planner.horizon, planner.discount, action_box,
                     seed=int(config.get("seed", 0)))

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
backups the value sees ``iterations`` horizons past the planner's own.

With method ``actor_critic`` the value is instead the critic of an actor trained in imagination (Dreamer's shape,
with a deterministic actor): from states of the training data the actor imagines the planner's horizon, TD(lambda)
returns bootstrapped from a slow copy of the critic are the critic's targets, and the actor climbs the same returns
through the model's gradients. Random sequences rarely keep a pole upright, so shooting's value is that of
flailing; a learned actor balances and pumps energy in imagination, and its critic says so.

Everything is seeded from the run's seed and runs on one thread, so the value, and every decision planned with it,
is a function of the checkpoint, the training data and the settings.
"""

from __future__ import annotations

import copy
import fcntl
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldpipe.control.dynamics import ControlError
from worldpipe.control.planners import Planner
from worldpipe.core.atomic import write_atomic
from worldpipe.core.hashing import canonical_hash
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore
from worldpipe.models import WorldModel
from worldpipe.rollout.engine import imagine_sequences

# The folder of a run's directory that holds its fitted values (one file per checkpoint and settings).
VALUE_DIR = "value"
# States imagined together in one backup (candidates each): bounds memory, not the result.
CHUNK_STATES = 256


@dataclass(frozen=True)
class ValueShare:
    """Where the value fitted for one checkpoint (``checkpoint_digest``) is kept for the other jobs that plan with it:
    a folder of the run's, each fit named by a hash of everything it is a function of."""

    directory: str
    checkpoint_digest: str


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
    """The terminal value of ``model`` fitted on the states of ``windows`` (:func:`training_windows`) by the
    settings' method (:mod:`worldpipe.config.value`): ``settings['iterations']`` backups of ``horizon`` imagined
    steps, or an actor and critic trained in imagination (:func:`fit_actor_critic`)."""
    if settings.get("method") == "actor_critic":
        return fit_actor_critic(model, windows, settings, horizon, discount, action_box, seed)[0]
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


class Actor(torch.nn.Module):
    """a(observation): an MLP on the model's normalised observation, squashed into the action box."""

    def __init__(self, model: WorldModel, hidden: int, action_box: tuple[float, float]) -> None:
        super().__init__()
        low, high = action_box
        self.middle, self.half_width = (high + low) / 2, (high - low) / 2
        self.net = torch.nn.Sequential(torch.nn.Linear(model.obs_dim, hidden), torch.nn.ELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ELU(),
                                       torch.nn.Linear(hidden, model.act_dim))

    def forward(self, normalized: torch.Tensor) -> torch.Tensor:
        """Actions [...,A] for normalised observations [...,O]."""
        return self.middle + self.half_width * torch.tanh(self.net(normalized))


def lambda_returns(rewards: torch.Tensor, values: torch.Tensor, discount: float, td_lambda: float) -> torch.Tensor:
    """TD(lambda) returns [N,H] of imagined rewards [N,H] with values [N,H+1] of the states they reach (the last
    one bootstraps): G_t = r_t + discount ((1 - lambda) V_{t+1} + lambda G_{t+1}), G_H = V_H."""
    returns = [values[:, -1]]
    for t in reversed(range(rewards.shape[1])):
        returns.append(rewards[:, t] + discount * ((1 - td_lambda) * values[:, t + 1] + td_lambda * returns[-1]))
    return torch.stack(returns[:0:-1], dim=1)


def fit_actor_critic(model: WorldModel, windows: tuple[torch.Tensor, torch.Tensor], settings: dict[str, Any],
                     horizon: int, discount: float, action_box: tuple[float, float],
                     seed: int) -> tuple[TerminalValue, Actor]:
    """The critic and the actor trained together in imagination on ``model`` from the states of ``windows``: each
    of ``fit_steps`` updates imagines ``horizon`` steps from ``batch`` states with the actor's noisy actions, then
    regresses the critic on TD(lambda) returns (bootstrapped from its slow copy) and steps the actor up them."""
    obs, actions = windows
    low, high = action_box
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = TerminalValue(model, int(settings["hidden"]))
        actor = Actor(model, int(settings["hidden"]), action_box)
    slow_critic = copy.deepcopy(critic).requires_grad_(False)
    critic_step = torch.optim.Adam(critic.parameters(), lr=float(settings["learning_rate"]))
    actor_step = torch.optim.Adam(actor.parameters(), lr=float(settings["actor_learning_rate"]))
    with torch.no_grad():
        start = model.observe_context((obs - model.obs_mean) / model.obs_std, actions)
    first = (obs[:, -1] - model.obs_mean) / model.obs_std  # [N,O] normalised: what the actor reads
    weights = discount ** torch.arange(horizon, dtype=torch.float32)
    noise_scale = float(settings["actor_noise"]) * (high - low) / 2
    td_lambda, blend = float(settings["td_lambda"]), float(settings["target_update"])
    trainable = [parameter.requires_grad for parameter in model.parameters()]
    model.requires_grad_(False)  # gradients flow through the model's activations, not into its weights
    try:
        for _ in range(int(settings["fit_steps"])):
            rows = torch.randint(0, first.shape[0], (int(settings["batch"]),), generator=generator)
            state = {key: part[rows] for key, part in start.items()}
            current, visited, rewards = first[rows], [first[rows]], []
            for _t in range(horizon):
                noise = torch.randn(current.shape[0], model.act_dim, generator=generator) * noise_scale
                current, reward, state = model.imagine_step(state, (actor(current) + noise).clamp(low, high))
                visited.append(current)
                rewards.append(reward)
            raw = torch.stack(visited, dim=1) * model.obs_std + model.obs_mean  # [B,H+1,O]
            returns = lambda_returns(torch.stack(rewards, dim=1), slow_critic(raw), discount, td_lambda)
            actor_loss = -(returns * weights).mean()
            actor_step.zero_grad()
            actor_loss.backward()
            actor_step.step()
            critic_loss = (critic(raw[:, :-1].detach()) - returns.detach()).pow(2).mean()
            critic_step.zero_grad()
            critic_loss.backward()
            critic_step.step()
            with torch.no_grad():
                for slow, fast in zip(slow_critic.parameters(), critic.parameters(), strict=True):
                    slow.lerp_(fast, blend)
    finally:
        for parameter, flag in zip(model.parameters(), trainable, strict=True):
            parameter.requires_grad_(flag)
    return critic.eval().requires_grad_(False), actor.eval().requires_grad_(False)


def fitted_value(model: WorldModel, config: dict[str, Any], settings: dict[str, Any], planner: Planner,
                 context: int, action_box: tuple[float, float], share: ValueShare | None = None) -> TerminalValue:
    """The terminal value a planner uses with ``model``: fitted on the training data of the run whose recorded
    config is ``config``, over ``planner``'s horizon and discount, seeded from the run's seed.

    ``share``: where the fit of this checkpoint is kept for every other job that needs the same one (a round's
    collection and its closed-loop evaluation fit the same value from the same inputs; the second one loads it).
    """
    store = open_training_data(config)
    seed = int(config.get("seed", 0))

    def fit() -> TerminalValue:
        return fit_value(model, training_windows(store, int(settings["states"]), context), settings, planner.horizon,
                         planner.discount, action_box, seed)

    if share is None:
        return fit()
    key = canonical_hash({"checkpoint_digest": share.checkpoint_digest, "dataset_hash": store.manifest["dataset_hash"],
                          "settings": settings, "horizon": planner.horizon, "discount": planner.discount,
                          "context": context, "action_box": list(action_box), "seed": seed})[:16]
    path = Path(share.directory) / f"value-{key}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    # One fit per key: a second job waits for the first one's fit instead of repeating it, then loads its file.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        if path.is_file():
            value = TerminalValue(model, int(settings["hidden"]))
            value.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return value.eval().requires_grad_(False)
        value = fit()
        buffer = io.BytesIO()
        torch.save(value.state_dict(), buffer)
        write_atomic(path, buffer.getvalue())
        return value
    finally:
        os.close(directory)  # releases the lock

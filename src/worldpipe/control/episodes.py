"""The closed loop: an agent acts in the real Gymnasium environment, one decision per environment step.

Each real step is split on its critical path, in the order it happens:

    capture     the observation the agent sees (the state vector; for a pixel model the rendered, downscaled frame)
    prepare     input preparation: the history window as tensors, normalised (the model's filter is model work)
    transport   request, queueing and response when the model is served over HTTP (0 in-process)
    model       every model call of the decision: filtering the window and all imagined rollouts
    output      turning what the model returned into the planner's numbers (in-process: folded into decision)
    decision    the planner's own arithmetic: sampling candidates, weighting, refitting, choosing
    actuation   ``env.step`` of the chosen action

An episode is a pure function of (env, reset seed, agent, its recorded noise stream): the planner's generator is
reseeded at every decision from :func:`worldpipe.rollout.streams.seed_for_step`, so reruns give the same actions.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from worldpipe.control.planners import Planner
from worldpipe.data.environments import env_action, env_dims, make_env
from worldpipe.data.pixels import downscale
from worldpipe.data.policies import Policy
from worldpipe.rollout.engine import imagine_sequences
from worldpipe.rollout.streams import StreamId, seed_for_step

PARTS = ("capture", "prepare", "transport", "model", "output", "decision", "actuation")


@dataclass
class EpisodeResult:
    """Return, length, the SHA-256 of every action taken (float32 bytes), per-step timings in seconds by part,
    when asked for, the true and imagined frames of a pixel model's episode, and the trajectory itself: what the
    agent saw, did and got (``rewards[t]``, ``terminated[t]`` after ``actions[t]``), which collection stores."""

    episode_return: float
    length: int
    actions_sha256: str
    timings: dict[str, list[float]] = field(default_factory=dict)
    frames: list[np.ndarray] = field(default_factory=list)
    imagined: list[np.ndarray] = field(default_factory=list)
    observations: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    terminated: list[bool] = field(default_factory=list)


class PolicyAgent:
    """A scripted policy (random, or the behaviour policy that collected the training data)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def reset(self, act_dim: int, rng: np.random.Generator) -> None:
        self.rng = rng

    def act(self, observations: list[np.ndarray], actions: list[np.ndarray], step: int,
            timing: dict[str, float]) -> np.ndarray:
        t0 = time.perf_counter()
        action = self.policy(observations[-1], self.rng)
        timing["decision"] = time.perf_counter() - t0
        return action


class PlannerAgent:
    """A planner acting through a dynamics (a learned model, the true simulator, or a served model)."""

    def __init__(self, planner: Planner, dynamics, stream: StreamId, record_imagined: bool = False) -> None:
        self.planner, self.dynamics, self.stream = planner, dynamics, stream
        self.generator = torch.Generator()
        # The observation the model imagined after each chosen action (its plan's first step): what the GIF of a
        # pixel model's episode shows beside the true frames. Outside the timed parts.
        self.record_imagined = record_imagined
        self.imagined: list[np.ndarray] = []

    def reset(self, act_dim: int, rng: np.random.Generator) -> None:
        self.planner.reset(act_dim)

    def act(self, observations: list[np.ndarray], actions: list[np.ndarray], step: int,
            timing: dict[str, float]) -> np.ndarray:
        t0 = time.perf_counter()
        context = getattr(self.dynamics, "context", 1)
        window = torch.from_numpy(np.stack(observations[-context:]))
        taken = torch.from_numpy(np.stack(actions[-(window.shape[0] - 1):])) if window.shape[0] > 1 else None
        t1 = time.perf_counter()
        self.dynamics.observe(window, taken if taken is not None else window.new_zeros(0, self.planner.mean.shape[1]))
        t2 = time.perf_counter()
        timing["prepare"], timing["model"] = t1 - t0, t2 - t1
        action = self.planner.plan(self.dynamics, seed_for_step(self.stream, step, self.generator), timing)
        imagine = timing.pop("imagine", 0.0)
        # A served model says how its round trips split (preparation, transport, model, output); in-process, all
        # of imagining is model work.
        split = self.dynamics.take_timing() if hasattr(self.dynamics, "take_timing") else {"model": imagine}
        for part, seconds in split.items():
            timing[part] = timing.get(part, 0.0) + seconds
        if self.record_imagined:
            predicted, _ = imagine_sequences(self.dynamics.model, self.dynamics.state, self.planner.last_plan[None])
            self.imagined.append(predicted[0, 0].numpy())
        return action.numpy().astype(np.float32)


def run_episode(env_id: str, max_steps: int, reset_seed: int, rng: np.random.Generator, agent,
                pixel_size: int | None = None, env_options: dict | None = None) -> EpisodeResult:
    """Let ``agent`` act in ``env_id`` for one episode from ``reset_seed``.

    ``pixel_size``: the agent observes rendered frames downscaled to this size, flattened (a pixel model).
    ``env_options``: how the env is made beyond its id (``make_env``: action repeat, observation key order).
    """
    dims = env_dims(env_id)
    env = make_env(env_id, max_steps, render=pixel_size is not None, **(env_options or {}))
    timings: dict[str, list[float]] = {part: [] for part in PARTS}
    observations: list[np.ndarray] = []
    actions: list[np.ndarray] = []
    rewards: list[float] = []
    ended: list[bool] = []
    digest = hashlib.sha256()
    total = 0.0
    try:
        obs, _ = env.reset(seed=reset_seed)
        agent.reset(dims.act_dim, rng)
        for step in range(max_steps):
            timing: dict[str, float] = {}
            t0 = time.perf_counter()
            if pixel_size is None:
                seen = np.asarray(obs, np.float32).reshape(-1)
            else:
                seen = downscale(env.render(), pixel_size).reshape(-1).astype(np.float32)
            observations.append(seen)
            timing["capture"] = time.perf_counter() - t0
            action = np.asarray(agent.act(observations, actions, step, timing), np.float32).reshape(dims.act_dim)
            actions.append(action)
            digest.update(action.tobytes())
            t1 = time.perf_counter()
            obs, reward, terminated, truncated, _ = env.step(env_action(action, dims))
            timing["actuation"] = time.perf_counter() - t1
            total += float(reward)
            rewards.append(float(reward))
            ended.append(bool(terminated))
            for part in PARTS:
                timings[part].append(timing.get(part, 0.0))
            if terminated or truncated:
                break
    finally:
        env.close()
    imagined = getattr(agent, "imagined", [])
    # frames[t] is what the agent saw at step t; imagined[t] the model's prediction of the frame after action t.
    return EpisodeResult(total, len(actions), digest.hexdigest(), timings, observations if imagined else [], imagined,
                         observations, actions, rewards, ended)

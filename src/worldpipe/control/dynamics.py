"""What a planner imagines with: a learned world model, or the true simulator (the ceiling it is compared with).

Both answer the same two questions, so a planner never knows which one it drives:

* :meth:`observe` — the real history so far (raw observations [T,O], actions [T-1,A]) sets the state that
  imagined trajectories start from;
* :meth:`imagine` — rewards [N,H] of N action sequences [N,H,A] from that state.

A learned model filters the last ``context`` steps of the history (the window it was evaluated with), then
imagines all N sequences in one batch through :func:`worldpipe.rollout.engine.imagine_sequences`. Imagination
takes the model's means (no sampled latents), so a decision is a function of the history and the planner's own
noise only.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import time

import numpy as np
import torch

from worldpipe.control.mujoco_simulator import TASKS as MUJOCO_TASKS
from worldpipe.control.mujoco_simulator import MuJoCoSimulator
from worldpipe.core.errors import UserError
from worldpipe.models import RolloutState, WorldModel
from worldpipe.rollout.engine import imagine_sequences


class ControlError(UserError):
    """A closed-loop evaluation that cannot run as configured (one line, no traceback)."""


class LearnedDynamics:
    """A trained world model as the planner's simulator; with a terminal ``value`` (:mod:`worldpipe.control.value`),
    each sequence's last imagined reward also carries ``discount`` times the value of the observation it ends in,
    so a planner's discounted sum is its return over the horizon plus the discounted value beyond."""

    def __init__(self, model: WorldModel, context: int, value: torch.nn.Module | None = None,
                 discount: float = 1.0) -> None:
        if context < 1:
            raise ControlError(f"control context must be >= 1 step, got {context}")
        self.model, self.context = model, int(context)
        self.value, self.discount = value, float(discount)
        self.state: RolloutState | None = None

    @torch.no_grad()
    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Filter the last ``context`` observations of obs [T,O] (raw) with the actions between them [T-1,A]."""
        window = obs[-self.context:]
        steps = window.shape[0]
        # observe_context reads actions[:C-1]; the last row is the action about to be chosen (a placeholder).
        taken = action[action.shape[0] - (steps - 1):] if steps > 1 else action[:0]
        actions = torch.cat([taken, taken.new_zeros(1, self.model.act_dim)])
        normalized = (window - self.model.obs_mean) / self.model.obs_std
        self.state = self.model.observe_context(normalized.unsqueeze(0), actions.unsqueeze(0))

    @torch.no_grad()
    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Predicted rewards [N,H] of action sequences [N,H,A] from the observed state."""
        return self.imagine_observations(actions)[1]

    @torch.no_grad()
    def imagine_observations(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted observations [N,H,O] (raw units) and rewards [N,H] of action sequences [N,H,A]."""
        observations, rewards = imagine_sequences(self.model, self.state, actions)
        if self.value is not None:
            rewards = torch.cat([rewards[:, :-1], rewards[:, -1:] + self.discount * self.value(observations[:, -1:])],
                                dim=1)
        return observations, rewards


class ServedDynamics:
    """A model served by ``worldpipe serve``, asked over HTTP: one ``/imagine/candidates`` request per planner
    iteration, carrying the context window and every candidate (the server filters and imagines in one batch).

    Timing of each round trip, by part: ``prepare`` (the request body), ``transport`` (request and response on the
    wire: the round trip less the server app's time, its ``Server-Timing`` header), ``model`` (the server's model
    work), ``output`` (the server's reading, parsing, queueing and serialising, and decoding the answer here).
    """

    def __init__(self, url: str, context: int, act_dim: int, timeout_s: float = 60.0) -> None:
        from urllib.parse import urlsplit

        self.url, self.context, self.act_dim, self.timeout_s = url.rstrip("/"), int(context), act_dim, timeout_s
        self.address = urlsplit(self.url)
        self.connection = None
        self.window: dict | None = None
        self.timing: dict[str, float] = {}

    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Keep the window to send (the server filters it with every request)."""
        window = obs[-self.context:]
        taken = action[action.shape[0] - (window.shape[0] - 1):] if window.shape[0] > 1 else action[:0]
        actions = torch.cat([taken, taken.new_zeros(1, self.act_dim)])
        self.window = {"obs": window.tolist(), "action": actions.tolist()}

    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Predicted rewards [N,H] of action sequences [N,H,A], imagined by the server."""
        t0 = time.perf_counter()
        # The candidates and their rewards travel as float32 bytes: exact, and cheap to write and read.
        values = actions.to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        candidates = {"shape": list(values.shape), "data": base64.b64encode(values.tobytes()).decode("ascii")}
        body = json.dumps({"context": self.window, "candidates_f32": candidates}).encode()
        t1 = time.perf_counter()
        status, data, server_timing = self._post("/imagine/candidates", body)
        t2 = time.perf_counter()
        if status != 200:
            raise ControlError(f"{self.url}/imagine/candidates answered {status}: "
                               f"{data.decode(errors='replace')[:300]}")
        answer = json.loads(data)
        packed = answer["rewards_f32"]
        rewards = torch.from_numpy(np.frombuffer(base64.b64decode(packed["data"]), dtype="<f4").astype(np.float32))
        rewards = rewards.reshape(packed["shape"])
        t3 = time.perf_counter()
        server = answer["timing"]
        # A server without the header: its handler time is all that can be told apart from the wire.
        app_s = _app_seconds(server_timing) or server["handler_s"]
        for part, seconds in (("prepare", t1 - t0), ("transport", (t2 - t1) - app_s),
                              ("model", server["model_s"]),
                              ("output", app_s - server["model_s"] + (t3 - t2))):
            self.timing[part] = self.timing.get(part, 0.0) + seconds
        return rewards

    def _post(self, path: str, body: bytes) -> tuple[int, bytes, str | None]:
        """POST on one kept-alive connection (the standard library's client: its own cost per request is a
        fraction of a general-purpose one's, and it sends headers and body in one write); a connection the server
        closed while idle is opened again once (scoring candidates has no side effect)."""
        import http.client  # start-up: HTTP client only where a served model is planned with

        try:
            return self._round_trip(path, body)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.connection.close()
            self.connection = None
            return self._round_trip(path, body)

    def _round_trip(self, path: str, body: bytes) -> tuple[int, bytes, str | None]:
        import http.client

        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.address.hostname, self.address.port,
                                                         timeout=self.timeout_s)
        self.connection.request("POST", path, body=body, headers={"content-type": "application/json"})
        response = self.connection.getresponse()
        return response.status, response.read(), response.getheader("server-timing")

    def take_timing(self) -> dict[str, float]:
        """Seconds by part since the last call (and start again)."""
        timing, self.timing = self.timing, {}
        return timing


def _app_seconds(server_timing: str | None) -> float | None:
    """The served app's seconds in a ``Server-Timing: app;dur=<ms>`` header (None without one)."""
    for metric in (server_timing or "").split(","):
        name, _, params = metric.strip().partition(";")
        if name == "app":
            for param in params.split(";"):
                key, _, value = param.strip().partition("=")
                if key == "dur":
                    return float(value) / 1000
    return None


def _angle_normalize(theta: torch.Tensor) -> torch.Tensor:
    return torch.remainder(theta + math.pi, 2 * math.pi) - math.pi


class PendulumSimulator:
    """Gymnasium's Pendulum-v1 equations, batched in torch: the planner's ceiling (a perfect model).

    The state comes from the observation (cos, sin, angular velocity), as a learned model's does.
    """

    max_torque, max_speed, dt, g, m, length = 2.0, 8.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, action_repeat: int = 1, observation_keys=None) -> None:
        if action_repeat != 1 or observation_keys:
            raise ControlError("Pendulum-v1's true simulator steps once per action from a flat observation "
                               "(action_repeat 1, no observation_keys)")
        self.theta = self.theta_dot = None

    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Take the state from the newest observation [T,O]."""
        cos_th, sin_th, theta_dot = obs[-1].double()
        self.theta, self.theta_dot = torch.atan2(sin_th, cos_th), theta_dot

    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Exact rewards [N,H] of action sequences [N,H,1]."""
        n, horizon = actions.shape[:2]
        theta = self.theta.expand(n).clone()
        theta_dot = self.theta_dot.expand(n).clone()
        rewards = []
        for t in range(horizon):
            u = actions[:, t, 0].double().clamp(-self.max_torque, self.max_torque)
            rewards.append(-(_angle_normalize(theta) ** 2 + 0.1 * theta_dot**2 + 0.001 * u**2))
            accel = 3 * self.g / (2 * self.length) * torch.sin(theta) + 3.0 / (self.m * self.length**2) * u
            theta_dot = (theta_dot + accel * self.dt).clamp(-self.max_speed, self.max_speed)
            theta = theta + theta_dot * self.dt
        return torch.stack(rewards, dim=1).float()


TRUE_SIMULATORS = {"Pendulum-v1": PendulumSimulator,
                   **{task: functools.partial(MuJoCoSimulator, task) for task in MUJOCO_TASKS}}


def true_simulator(env_id: str, env_options: dict | None = None):
    """The batched exact simulator of ``env_id`` made as the env is (``env_options``: action repeat, observation
    key order); ControlError where the project has none."""
    try:
        return TRUE_SIMULATORS[env_id](**(env_options or {}))
    except KeyError:
        raise ControlError(f"no true simulator for {env_id!r} (have: {', '.join(TRUE_SIMULATORS)}); "
                           "closed-loop control is evaluated on those envs only") from None

"""The true simulator of DeepMind Control tasks: the task's own MuJoCo model, rolled out for every candidate.

MuJoCo's physics state can be copied: the planner's ceiling sets it from the newest observation (for these tasks the
observation determines the state: joint positions from the observed cosines and sines, velocities as observed),
rolls every candidate action sequence out in MuJoCo's batched ``rollout`` (each action held for ``action_repeat``
control steps, as the real env holds it), and scores the states with the task's reward, computed from the rolled-out
states with dm_control's own ``rewards.tolerance``. A test compares its rewards with the real env's.
"""

from __future__ import annotations

import numpy as np
import torch

# The tasks whose physics state follows from their observation (joint angles from cosines and sines).
TASKS = ("dm_control/cartpole-swingup-v0", "dm_control/pendulum-swingup-v0")
_COSINE_BOUND = float(np.cos(np.deg2rad(8)))  # dm_control's pendulum: upright within 8 degrees earns 1


class MuJoCoSimulator:
    """Exact (to MuJoCo's integration) rewards [N,H] of action sequences, from the observed state."""

    def __init__(self, env_id: str, action_repeat: int = 1, observation_keys=None) -> None:
        from dm_control import suite  # start-up: dm_control only where its tasks are planned in

        if env_id not in TASKS:
            raise ValueError(f"no MuJoCo true simulator for {env_id!r} (have: {', '.join(TASKS)})")
        domain, task = env_id.removeprefix("dm_control/").removesuffix("-v0").split("-")
        self.env_id, self.domain, self.repeat = env_id, domain, int(action_repeat)
        self.env = suite.load(domain, task, task_kwargs={"random": 0})
        self.physics = self.env.physics
        self.sub_steps = int(round(self.env.control_timestep() / self.physics.model.opt.timestep))
        spec = self.env.observation_spec()
        keys = list(observation_keys or spec)
        self.slices, start = {}, 0
        for key in keys:
            width = int(np.prod(spec[key].shape))
            self.slices[key] = slice(start, start + width)
            start += width
        self.state: np.ndarray | None = None

    def observe(self, obs: torch.Tensor, action: torch.Tensor) -> None:
        """Set the physics state from the newest observation [T,O]."""
        import mujoco

        last = obs[-1].double().numpy()
        if self.domain == "cartpole":
            x, cos, sin = last[self.slices["position"]]
            qpos, qvel = np.array([x, np.arctan2(sin, cos)]), last[self.slices["velocity"]]
        else:
            cos, sin = last[self.slices["orientation"]]
            qpos, qvel = np.array([np.arctan2(sin, cos)]), last[self.slices["velocity"]]
        model, data = self.physics.model.ptr, self.physics.data.ptr
        data.qpos[:], data.qvel[:] = qpos, qvel
        mujoco.mj_forward(model, data)
        self.state = np.empty(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_FULLPHYSICS))
        mujoco.mj_getState(model, data, self.state, mujoco.mjtState.mjSTATE_FULLPHYSICS)

    def imagine(self, actions: torch.Tensor) -> torch.Tensor:
        """Rewards [N,H] of action sequences [N,H,A]: each action held ``action_repeat`` control steps, their
        rewards summed, as the env with that action repeat gives them."""
        from mujoco import rollout

        n, horizon = actions.shape[:2]
        steps = self.repeat * self.sub_steps
        control = np.clip(actions.double().numpy(), -1.0, 1.0)
        controls = np.repeat(control, steps, axis=1)  # [N, H*steps, A]
        model, data = self.physics.model.ptr, self.physics.data.ptr
        states, _ = rollout.rollout(model, data, np.tile(self.state, (n, 1)), controls)
        nq, nv = model.nq, model.nv
        # The state after each control step (the reward is read there, with the action that led to it).
        at = states[:, self.sub_steps - 1::self.sub_steps]  # [N, H*repeat, nstate]
        qpos, qvel = at[..., 1:1 + nq], at[..., 1 + nq:1 + nq + nv]
        rewards = self._reward(qpos, qvel, np.repeat(control, self.repeat, axis=1))
        return torch.from_numpy(rewards.reshape(n, horizon, self.repeat).sum(axis=2)).float()

    def _reward(self, qpos: np.ndarray, qvel: np.ndarray, control: np.ndarray) -> np.ndarray:
        from dm_control.utils import rewards

        if self.domain == "pendulum":
            return rewards.tolerance(np.cos(qpos[..., 0]), (_COSINE_BOUND, 1))
        upright = (np.cos(qpos[..., 1]) + 1) / 2
        centered = (1 + rewards.tolerance(qpos[..., 0], margin=2)) / 2
        small_control = (4 + rewards.tolerance(control[..., 0], margin=1, value_at_margin=0,
                                               sigmoid="quadratic")) / 5
        small_velocity = (1 + rewards.tolerance(qvel[..., 1], margin=5)) / 2
        return upright * centered * small_control * small_velocity

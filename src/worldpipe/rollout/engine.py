"""Batched imagination: run many rollout jobs through one model, each row's bits independent of the batch.

CPU kernels pick their code path by batch size (a 1- or 2-row product is not computed like an 8-row one), and
some (batched matrix-vector products, reductions) by a row's memory alignment, i.e. its position in the batch.
So a row's bits can change with which other requests share its batch. Two rules keep them from changing:

* every model call runs on a batch padded to a multiple of :data:`ROW_MULTIPLE` rows (padding rows repeat
  row 0 and are discarded);
* a model is batched only if :func:`worldpipe.rollout.padding.probe_batch_invariance` found, when it was loaded, that each row's result
  is the same at every position and padded width; otherwise every job runs alone, as row 0 of a batch of one.

``tests/rollout/test_rollout_engine.py`` checks the result against single-job runs over many compositions.

Noise of imagined step k of a job is drawn from its stream (:mod:`worldpipe.rollout.streams`), so a job split
into a prefix and a continuation yields the same bits as the whole job.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from worldpipe.models import RolloutState
from worldpipe.rollout.padding import ROW_MULTIPLE, pad_rows, padded
from worldpipe.rollout.registry import ServedModel
from worldpipe.rollout.streams import StreamId, step_noise

SAMPLING_MODES = ("sample", "mean")


@dataclass(frozen=True)
class Sampling:
    """How imagined latents are drawn: ``sample`` (mean + noise_scale * std * noise) or ``mean`` (no noise)."""

    mode: str = "sample"
    noise_scale: float = 1.0

    def key(self) -> str:
        """Canonical hash of the config (part of every cache key)."""
        text = json.dumps({"mode": self.mode, "noise_scale": float(self.noise_scale)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def draws_noise(self) -> bool:
        return self.mode == "sample"


@dataclass
class RolloutJob:
    """One trajectory to imagine: from a context (raw observations) or from a rollout state already held.

    ``first_step`` is the absolute index of ``actions[0]`` among the imagined steps (0 right after the context),
    which keys the noise; ``stream`` is None only when ``sampling.mode == "mean"``.
    """

    served: ServedModel
    actions: torch.Tensor  # [H, A]
    sampling: Sampling
    stream: StreamId | None
    context_obs: torch.Tensor | None = None  # [C, O] raw units
    context_action: torch.Tensor | None = None  # [C, A]
    start: RolloutState | None = None  # batch of one, normalized units
    first_step: int = 0


@dataclass
class JobResult:
    """Imagined observations [H,O] (raw units), rewards [H] and the state after the last step (batch of one)."""

    obs: torch.Tensor
    reward: torch.Tensor
    state: RolloutState
    timing: dict = field(default_factory=dict)


# Every per-job rollout state ever handed out, while something still references it: the leak detector
# behind /stats (a closed session whose state is still alive somewhere shows up here).
LIVE_STATE_TENSORS: weakref.WeakSet = weakref.WeakSet()


def _row(state: RolloutState, i: int) -> RolloutState:
    # clone: the job's state must own its bytes, not keep the whole batch alive through a view
    row = {k: v[i:i + 1].clone() for k, v in state.items()}
    for tensor in row.values():
        LIVE_STATE_TENSORS.add(tensor)
    return row


def _signature(job: RolloutJob) -> tuple:
    noisy = job.sampling.draws_noise and job.served.model.rollout_noise_shape() is not None
    shapes = tuple(sorted((k, tuple(v.shape[1:]), str(v.dtype)) for k, v in job.start.items()))
    return job.served.version, noisy, shapes


@torch.no_grad()
def filter_contexts(jobs: list[RolloutJob], pad: bool = True) -> None:
    """Give every job without a start state the state after its context (batched by model and length)."""
    groups: dict[tuple, list[RolloutJob]] = defaultdict(list)
    for job in jobs:
        if job.start is None:
            groups[(job.served.version, job.context_obs.shape[0])].append(job)
    for group in groups.values():
        model = group[0].served.model
        width = padded(len(group), ROW_MULTIPLE if pad else 1)
        obs = pad_rows(torch.stack([j.context_obs for j in group]), width)
        action = pad_rows(torch.stack([j.context_action for j in group]), width)
        state = model.observe_context((obs - model.obs_mean) / model.obs_std, action)
        for i, job in enumerate(group):
            job.start = _row(state, i)


@torch.no_grad()
def imagine_group(group: list[RolloutJob]) -> list[JobResult]:
    """Imagine a group of jobs with the same model, noise use and state shapes, in one padded batch per step."""
    order = sorted(range(len(group)), key=lambda i: -group[i].actions.shape[0])
    jobs = [group[i] for i in order]
    served = jobs[0].served
    model, noise_shape = served.model, served.model.rollout_noise_shape()
    noisy = jobs[0].sampling.draws_noise and noise_shape is not None
    horizons = [j.actions.shape[0] for j in jobs]
    multiple = ROW_MULTIPLE if served.batch_invariant else 1
    width = padded(len(jobs), multiple)
    state = {k: pad_rows(torch.cat([j.start[k] for j in jobs]), width) for k in jobs[0].start}
    obs_out = [[] for _ in jobs]
    rew_out = [[] for _ in jobs]
    finals: list[RolloutState | None] = [j.start if h == 0 else None for j, h in zip(jobs, horizons, strict=True)]
    generator = torch.Generator()
    for t in range(max(horizons, default=0)):
        active = sum(h > t for h in horizons)
        if padded(active, multiple) < width:
            width = padded(active, multiple)
            state = {k: v[:width] for k, v in state.items()}
        action = pad_rows(torch.stack([jobs[i].actions[t] for i in range(active)]), width)
        noise = None
        if noisy:
            draws = [step_noise(j.stream, j.first_step + t, noise_shape, generator) * j.sampling.noise_scale
                     for j in jobs[:active]]
            noise = pad_rows(torch.stack(draws), width)
        obs, reward, state = model.imagine_step(state, action, noise)
        obs = obs * model.obs_std + model.obs_mean
        for i in range(active):
            obs_out[i].append(obs[i])
            rew_out[i].append(reward[i])
            if horizons[i] == t + 1:
                finals[i] = _row(state, i)
    results = [None] * len(jobs)
    for i, job in enumerate(jobs):
        empty_obs = job.actions.new_zeros(0, served.obs_dim)
        results[order[i]] = JobResult(torch.stack(obs_out[i]) if obs_out[i] else empty_obs,
                                      torch.stack(rew_out[i]) if rew_out[i] else job.actions.new_zeros(0),
                                      finals[i])
    return results


def run_jobs(jobs: list[RolloutJob]) -> list[JobResult]:
    """Results of ``jobs`` in order; jobs are batched by model, noise use and state shapes."""
    batchable = [j for j in jobs if j.served.batch_invariant]
    filter_contexts(batchable)
    for job in jobs:
        if not job.served.batch_invariant:
            filter_contexts([job], pad=False)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, job in enumerate(jobs):
        groups[_signature(job) if job.served.batch_invariant else ("alone", i)].append(i)
    results: list[JobResult | None] = [None] * len(jobs)
    for indices in groups.values():
        for i, result in zip(indices, imagine_group([jobs[i] for i in indices]), strict=True):
            results[i] = result
    return results


@torch.no_grad()
def imagine_sequences(model, start: RolloutState, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Imagine N action sequences [N,H,A] from one state (a batch of one), or from N states (one per sequence),
    with means: observations [N,H,O] (raw units) and rewards [N,H].

    What a planner asks for every candidate of one decision: the start state is shared by all N rows, so it is
    expanded (not copied) and the N sequences advance together, one batched model call per imagined step.
    """
    count, horizon = actions.shape[:2]
    state = {key: value.expand(count, *value.shape[1:]) for key, value in start.items()}
    observations, rewards = [], []
    for t in range(horizon):
        obs, reward, state = model.imagine_step(state, actions[:, t])
        observations.append(obs)
        rewards.append(reward)
    stacked = torch.stack(observations, dim=1) * model.obs_std + model.obs_mean
    return stacked, torch.stack(rewards, dim=1)

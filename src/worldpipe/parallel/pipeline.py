"""Pipeline parallelism: one training step of a model cut into stages, over microbatches.

Each rank of a pipeline group holds one stage (the model says where the boundaries are:
``WorldModel.pipeline_stage``). ``torch.distributed.pipelining`` runs the schedule (GPipe: every forward, then
every backward; 1F1B: one forward, one backward in the steady state, so at most P microbatches' activations
are alive per stage). The last stage computes the model's loss sums per microbatch; each is multiplied by the
layout's loss scale (1 / valid steps of the global batch), so the accumulated gradient is that of the global
mean whatever M is: the schedule's own 1/M scaling is turned off. Data-parallel replicas of a stage then sum
their gradients (one flattened all-reduce per stage).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


class PipelineRunner:
    """This rank's stage of a pipeline and the schedule that drives it."""

    def __init__(self, model: Any, stage_module: nn.Module, stage: int, stages: int, group: Any, dp_group: Any,
                 device: torch.device, microbatches: int, schedule: str = "gpipe") -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.model, self.stage_index, self.stages, self.dp_group = model, stage, stages, dp_group
        self.first, self.last = stage == 0, stage == stages - 1
        self.stage = PipelineStage(stage_module, stage, stages, device, group=group)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(self.stage, microbatches, loss_fn=self._loss, scale_grads=False)
        self.microbatches = microbatches
        self._scale, self._sums = 1.0, []  # per step: the loss scale, each microbatch's detached sums
        self.last_reduce_s = 0.0  # seconds the last step spent in the data-parallel gradient all-reduce

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # target packs [obs, reward, mask] on the last axis, so the schedule cuts it into microbatches for us.
        sums = self.model.pipeline_loss(output, target[..., :-2], target[..., -2], target[..., -1])
        # Copies: the schedule frees its tensors' storage after their backward.
        self._sums.append({k: v.detach().clone() for k, v in sums.items()})
        return sums["total"] * self._scale

    def step(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor,
             scale: float, terms: Sequence[str]) -> dict[str, torch.Tensor]:
        """Forward and backward of every microbatch; returns the loss sums (zero except on the last stage)."""
        self._scale, self._sums = scale, []
        args = (obs, action) if self.first else ()
        target = torch.cat([obs, reward.unsqueeze(-1), mask.unsqueeze(-1)], dim=-1) if self.last else None
        self.schedule.step(*args, target=target, return_outputs=False)
        self.reduce_gradients()
        zero = torch.zeros((), device=obs.device)
        # The first step's metadata inference calls the loss once more, on inference inputs: the step's own
        # microbatches are the last M calls.
        mine = self._sums[-self.microbatches:] if self.last else []
        return {k: sum((s[k] for s in mine), zero) for k in terms}

    def reduce_gradients(self) -> None:
        """Sum the stage's gradients over its data-parallel replicas (no-op without data parallelism)."""
        if self.dp_group is None:
            return
        start = time.perf_counter()
        grads = [p.grad for p in self.stage.submod.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.last_reduce_s = time.perf_counter() - start

"""A causal transformer world model: one token per time step, a deterministic next-step head.

Token t = Linear([o_t, a_t]); pre-norm blocks of causal multi-head self-attention and an MLP; the head at
token t predicts o_{t+1} - o_t and r_t (models/next_step.py). No positional encoding: causal attention already
knows the order, dynamics do not depend on the absolute time, and a rollout may run past the training window.

Partitioning: batch; tensor-parallel (query/key/value projections and the MLP's first layer split by output
column, the attention output and the MLP's second layer by input row: one all-reduce per block, each rank
computes heads/tp heads); time (ring attention: each rank keeps its queries and circulates key/value blocks);
pipeline stages (contiguous runs of blocks; the embedding joins the first stage, the final norm and head the last).
The rollout state is the key/value cache of every layer, which grows by one token per imagined step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from worldpipe.models.base import ParallelSupport, RolloutState, WorldModel
from worldpipe.models.next_step import LOSS_TERMS, TokenEmbedding, next_step_loss, split_prediction
from worldpipe.parallel.ring_attention import ring_attention
from worldpipe.parallel.time_partition import TimePartition

Tensor = torch.Tensor


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the head count per rank follows from the (possibly sharded) weights."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.head_dim = width // heads
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def _heads(self, x: Tensor) -> Tensor:
        batch, steps, _ = x.shape
        return x.view(batch, steps, -1, self.head_dim).transpose(1, 2)  # [B, H_local, T, dh]

    def forward(self, x: Tensor, partition: TimePartition | None = None,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B,T,W] -> ([B,T,W], this call's (keys, values) including ``past``).

        Without ``past`` the T tokens attend causally (across ranks when ``partition`` is split); with
        ``past`` (a cache) the new tokens attend to all cached ones and causally among themselves.
        """
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if partition is not None and partition.is_split:
            y = ring_attention(q, k, v, partition.group, stats=partition.stats)
        elif past is not None and q.shape[2] == 1:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, steps, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(batch, steps, -1)), (k, v)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x: Tensor, partition: TimePartition | None = None,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B,T,W] -> ([B,T,W], (keys, values))."""
        attended, kv = self.attn(self.norm1(x), partition, past)
        x = x + attended
        return x + self.mlp(self.norm2(x)), kv


class PipelineStageModule(nn.Module):
    """One pipeline stage: (embedding,) a run of blocks, (final norm and head); shares the model's modules."""

    def __init__(self, embed: nn.Module | None, blocks: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module | None):
        super().__init__()
        self.embed, self.blocks, self.norm, self.head = embed, nn.ModuleList(blocks), norm, head
        self.recompute = False

    def forward(self, *inputs: Tensor) -> Tensor:
        """(obs, action) on the first stage, the previous stage's tokens [B,T,W] on the others."""
        x = self.embed(*inputs) if self.embed is not None else inputs[0]
        for block in self.blocks:
            x, _ = run_block(block, x, None, None, self.recompute)
        return self.head(self.norm(x)) if self.head is not None else x


def run_block(block: nn.Module, x: Tensor, partition: TimePartition | None, past: Any,
              recompute: bool) -> tuple[Tensor, Any]:
    """One block; with ``recompute`` (training) only its input is kept for backward, the rest recomputed then."""
    if recompute and torch.is_grad_enabled() and past is None:

        return checkpoint(block, x, partition, None, use_reentrant=False)
    return block(x, partition, past)


def stage_blocks(layers: int, stages: int, stage: int) -> range:
    """The blocks of pipeline stage ``stage``: contiguous, sizes differing by at most one."""
    return range(stage * layers // stages, (stage + 1) * layers // stages)


class CausalTransformer(WorldModel):
    """Deterministic causal transformer over (observation, action) tokens."""

    loss_terms = LOSS_TERMS
    # The class-level answer; an instance narrows max_tensor_parallel to its head count.
    parallel = ParallelSupport(batch=True, tensor_parallel=True, time_partition="ring_attention")
    state_grows = True
    dimensions = ("width", "heads", "layers", "mlp_ratio")

    def __init__(self, obs_dim: int, act_dim: int, width: int = 64, heads: int = 4, layers: int = 2,
                 mlp_ratio: int = 2, reward_scale: float = 1.0):
        super().__init__(obs_dim, act_dim)
        self.parallel = self.parallel_support(heads=heads, layers=layers)
        self.heads, self.reward_scale = heads, reward_scale
        self.embed = TokenEmbedding(obs_dim, act_dim, width)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, obs_dim + 1)
        self.partition: TimePartition | None = None
        self.recompute = False

    @classmethod
    def parallel_support(cls, **model_kwargs: Any) -> ParallelSupport:
        """Batch, tensor-parallel up to one head per rank, and ring attention in time."""
        heads = int(model_kwargs.get("heads", 4))
        return ParallelSupport(batch=True, tensor_parallel=True, time_partition="ring_attention",
                               max_tensor_parallel=heads, pipeline_blocks=int(model_kwargs.get("layers", 2)),
                               recompute=True)

    def enable_recompute(self) -> None:
        """Run every block under non-reentrant activation checkpointing (also inside pipeline stages)."""
        self.recompute = True

    def pipeline_stage(self, stage: int, stages: int) -> nn.Module:
        """Keep the embedding (first stage), this stage's blocks, the norm and head (last stage); drop the rest.

        Dropped blocks become parameterless placeholders, so the kept ones keep their full-model names.
        """
        mine = stage_blocks(len(self.blocks), stages, stage)
        for index in range(len(self.blocks)):
            if index not in mine:
                self.blocks[index] = nn.Identity()
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.norm = self.head = None
        stage_module = PipelineStageModule(self.embed, [self.blocks[i] for i in mine], self.norm, self.head)
        stage_module.recompute = self.recompute
        return stage_module

    def pipeline_loss(self, output: Tensor, obs: Tensor, reward: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """Next-step loss sums of the head outputs of whole windows."""
        return next_step_loss(output, obs, reward, mask, None, self.reward_scale)

    def bind_time_partition(self, partition: TimePartition) -> None:
        """Run ``forward`` on this rank's chunk of time; attention rings over ``partition.group``."""
        self.partition = partition

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Any]:
        """Column-wise q/k/v and MLP input, row-wise attention output and MLP output, per block.

        ``sequence_parallel`` (Megatron's sequence parallelism): the residual stream and the norms hold sequence
        shards between the tensor-parallel regions; each region's input is all-gathered in time and its row-wise
        output reduce-scattered in time (the all-reduce split in two), so norm activations are 1/tp per rank.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            return self._sequence_parallel_plan()
        plan: dict[str, Any] = {}
        for index in range(len(self.blocks)):
            prefix = f"blocks.{index}"
            for name in ("attn.query", "attn.key", "attn.value", "mlp.0"):
                plan[f"{prefix}.{name}"] = ColwiseParallel()
            for name in ("attn.out", "mlp.2"):
                plan[f"{prefix}.{name}"] = RowwiseParallel()
        return plan

    def _sequence_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        def gather_in_time(args: int = 1) -> PrepareModuleInput:
            # The first argument is all-gathered in time; the rest (partition, cache: None) pass untouched.
            rest = (None,) * (args - 1)
            return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest),
                                      use_local_output=True)

        # The embedding's output is cut in time; the final norm and head see whole windows again (the loss).
        plan: dict[str, Any] = {
            "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                         use_local_output=False),
            "norm": gather_in_time(),
        }
        for index in range(len(self.blocks)):
            prefix = f"blocks.{index}"
            for name in ("norm1", "norm2"):
                plan[f"{prefix}.{name}"] = SequenceParallel()
            plan[f"{prefix}.attn"] = gather_in_time(3)
            plan[f"{prefix}.mlp"] = gather_in_time()
            for name in ("attn.query", "attn.key", "attn.value", "mlp.0"):
                plan[f"{prefix}.{name}"] = ColwiseParallel()
            for name in ("attn.out", "mlp.2"):
                plan[f"{prefix}.{name}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return plan

    def _run(self, x: Tensor, partition: TimePartition | None = None,
             past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        caches = []
        for index, block in enumerate(self.blocks):
            x, kv = run_block(block, x, partition, None if past is None else past[index], self.recompute)
            caches.append(kv)
        return self.head(self.norm(x)), caches

    def forward(self, obs, action, reward, mask, noise) -> dict[str, Tensor]:
        """Per-term loss sums over this rank's windows (or its time chunk of them); ``noise`` is unused."""
        output, _ = self._run(self.embed(obs, action), self.partition)
        return next_step_loss(output, obs, reward, mask, self.partition, self.reward_scale)

    def observe_context(self, obs: Tensor, action: Tensor) -> RolloutState:
        """The key/value cache of tokens 0..C-2 and the last observation o_{C-1}."""
        batch = obs.shape[0]
        if obs.shape[1] > 1:
            _, caches = self._run(self.embed(obs[:, :-1], action[:, :-1]))
        else:
            empty = obs.new_zeros(batch, self.heads, 0, self.blocks[0].attn.head_dim)
            caches = [(empty, empty) for _ in self.blocks]
        state = {"last_obs": obs[:, -1]}
        for index, (k, v) in enumerate(caches):
            state[f"k{index}"], state[f"v{index}"] = k, v
        return state

    def imagine_step(self, state: RolloutState, action: Tensor,
                     noise: Tensor | None = None) -> tuple[Tensor, Tensor, RolloutState]:
        """Append the token (last observation, action) to the cache; predict the next observation and reward."""
        token = self.embed(state["last_obs"], action).unsqueeze(1)
        past = [(state[f"k{i}"], state[f"v{i}"]) for i in range(len(self.blocks))]
        output, caches = self._run(token, past=past)
        obs_pred, reward_pred = split_prediction(state["last_obs"], output[:, 0])
        new_state = {"last_obs": obs_pred}
        for index, (k, v) in enumerate(caches):
            new_state[f"k{index}"], new_state[f"v{index}"] = k, v
        return obs_pred, reward_pred, new_state

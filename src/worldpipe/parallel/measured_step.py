"""One training step of a built model under a layout, measured: memory per rank by category and the collectives
of the step, the quantities :mod:`worldpipe.parallel.forecast` predicts.

The step is the trainer's (``Layout.forward_backward``, ``Layout.clip_grad_norm``, AdamW), on a synthetic batch
of the global shape; one warm-up step first (a pipeline infers its shapes, AdamW creates its state), then the
counted step. Activations are the storages autograd saves during forward passes (not a recomputation's, in
backward); a pipeline's are those of every microbatch of the schedule. Used by ``worldpipe bench plan`` and the
forecast's test, so prediction is held against one measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worldpipe.parallel.collectives import CollectiveCounter
from worldpipe.parallel.layout import build_layout
from worldpipe.parallel.memory import saved_activations, state_bytes
from worldpipe.parallel.runtime import Runtime


def synthetic_batch(windows: int, steps: int, obs_dim: int, act_dim: int, seed: int = 1) -> dict[str, Any]:
    """A global batch of random windows, every step valid (the forecast's shapes, not a dataset's values)."""
    gen = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(windows, steps, obs_dim, generator=gen),
            "action": torch.randn(windows, steps, act_dim, generator=gen),
            "reward": torch.randn(windows, steps, generator=gen), "mask": torch.ones(windows, steps), "noise": None}


def _train_step(layout, model: nn.Module, optimizer, part: Mapping[str, Any], valid: int, grad_clip: float,
                terms: tuple[str, ...]) -> None:
    optimizer.zero_grad(set_to_none=True)  # at the start: the step's gradients are measured after it
    layout.forward_backward(model, part, valid, terms)
    layout.clip_grad_norm(model.parameters(), grad_clip)
    optimizer.step()


def measure_layout(model: nn.Module, parallel_cfg: Mapping[str, Any], runtime: Runtime, batch: Mapping[str, Any],
                   grad_clip: float) -> dict[str, Any]:
    """Wrap ``model`` (built, unwrapped, the same on every rank) in the layout, train two steps on this rank's part
    of the global ``batch``, and return every rank's memory by category and communication of the second step
    (collective: call it on every rank)."""
    layout = build_layout(parallel_cfg, runtime)
    terms = tuple(model.loss_terms)
    wrapped = layout.wrap(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, **layout.optimizer_kwargs)
    rows = batch["obs"].shape[0] // layout.dp_size
    part = layout.shard_batch({k: None if v is None else v[layout.dp_rank * rows:(layout.dp_rank + 1) * rows]
                               for k, v in batch.items()})
    valid = int(batch["mask"].sum())
    _train_step(layout, wrapped, optimizer, part, valid, grad_clip, terms)
    with CollectiveCounter(pipeline=layout.pipeline is not None) as counter, saved_activations(wrapped) as saved:
        _train_step(layout, wrapped, optimizer, part, valid, grad_clip, terms)
    mine = {"rank": runtime.rank, "memory": {**state_bytes(wrapped, optimizer), "activations": sum(saved.values())},
            "comm": counter.comm}
    if not runtime.distributed:
        return {"ranks": [mine]}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine)
    return {"ranks": gathered}


def largest_rank_memory(measured: Mapping[str, Any]) -> dict[str, int]:
    """Per category, the most any rank holds (the forecast predicts the largest rank)."""
    ranks = measured["ranks"]
    return {cat: max(r["memory"][cat] for r in ranks) for cat in ranks[0]["memory"]}

"""Row padding of batched model calls, and the probe that decides whether a model may be batched at all.

Every batched call runs on a batch padded to a multiple of :data:`ROW_MULTIPLE` rows (padding rows repeat row 0
and are discarded), so the shapes a model sees do not depend on how many jobs happened to arrive together.
"""

from __future__ import annotations

import torch

ROW_MULTIPLE = 8


def padded(n: int, multiple: int = ROW_MULTIPLE) -> int:
    """Rows actually computed for ``n`` rows of work."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with rows appended (copies of row 0) up to ``width`` rows."""
    if t.shape[0] == width:
        return t
    return torch.cat([t, t[:1].expand(width - t.shape[0], *t.shape[1:])], dim=0)


@torch.no_grad()
def probe_batch_invariance(model, obs_dim: int, act_dim: int, rows: int = 24, steps: int = 3) -> bool:
    """True when every row of a random rollout has the same bits at every batch position and padded width."""
    g = torch.Generator().manual_seed(0)
    obs, action = torch.randn(rows, 3, obs_dim, generator=g), torch.randn(rows, 3 + steps, act_dim, generator=g)
    shape = model.rollout_noise_shape()
    noise = None if shape is None else torch.randn(steps, rows, *shape, generator=g)

    def run(order: torch.Tensor, width: int) -> torch.Tensor:
        idx = pad_rows(order, width)
        state, outputs = model.observe_context(obs[idx], action[idx, :3]), []
        for t in range(steps):
            out, reward, state = model.imagine_step(state, action[idx, 3 + t], None if noise is None else noise[t][idx])
            outputs.append(torch.cat([out, reward.unsqueeze(-1)], dim=-1))
        result = torch.stack(outputs, dim=1)[:len(order)]
        return result[torch.argsort(order)]

    reference = run(torch.arange(rows), padded(rows))
    for seed, width in ((1, ROW_MULTIPLE), (2, 2 * ROW_MULTIPLE), (3, padded(rows)), (4, padded(rows) + ROW_MULTIPLE)):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:min(rows, width)]
        if not torch.equal(run(order, width), reference[order.sort().values]):
            return False
    return True

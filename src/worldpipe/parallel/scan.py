"""The affine recurrence h_t = a_t * h_{t-1} + b_t as a parallel associative scan, within a rank and across ranks.

An element (a, b) is the affine map h -> a*h + b (diagonal a: elementwise). Applying (a1, b1) then (a2, b2) is
again affine: (a2*a1, a2*b1 + b2). The composition is associative, so the prefix compositions of a sequence
can be computed in log2(T) parallel rounds instead of T sequential steps (a Hillis-Steele scan), and h_t is the
t-th prefix applied to the initial state h_{-1}.

Across ranks (time split into consecutive chunks, rank r holding chunk r): every rank scans its chunk locally
and gathers the other ranks' chunk summaries (the composition of a whole chunk: two [B, D] tensors each);
rank r composes the summaries of chunks 0..r-1 into its boundary state, the h entering its chunk, then applies
its local prefixes to it. Communication: one all-gather of 2·B·D values per rank, independent of T. Both the
scan and the exchange are differentiable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The affine map 'apply ``first``, then ``second``': (a2*a1, a2*b1 + b2)."""
    (a1, b1), (a2, b2) = first, second
    return a2 * a1, a2 * b1 + b2


def associative_scan(a: Tensor, b: Tensor, dim: int = 1) -> tuple[Tensor, Tensor]:
    """Inclusive prefix compositions along ``dim``: element t is the composition of elements 0..t.

    Hillis-Steele: in round k every element composes with the one 2^k before it; ceil(log2 T) rounds.
    """
    length, offset = a.shape[dim], 1
    while offset < length:
        earlier = (a.narrow(dim, 0, length - offset), b.narrow(dim, 0, length - offset))
        later = (a.narrow(dim, offset, length - offset), b.narrow(dim, offset, length - offset))
        a_new, b_new = compose(earlier, later)
        a = torch.cat([a.narrow(dim, 0, offset), a_new], dim=dim)
        b = torch.cat([b.narrow(dim, 0, offset), b_new], dim=dim)
        offset *= 2
    return a, b


def sequential_scan(a: Tensor, b: Tensor, h0: Tensor | None = None, dim: int = 1) -> Tensor:
    """Reference: the recurrence as a plain loop over ``dim``; h_{-1} = ``h0`` (zeros when None)."""
    h = torch.zeros_like(b.select(dim, 0)) if h0 is None else h0
    states = []
    for t in range(a.shape[dim]):
        h = a.select(dim, t) * h + b.select(dim, t)
        states.append(h)
    return torch.stack(states, dim=dim)


def apply_prefixes(a_cum: Tensor, b_cum: Tensor, h_in: Tensor | None, dim: int = 1) -> Tensor:
    """States h_t = a_cum_t * h_in + b_cum_t of a chunk whose entering state is ``h_in`` (None: zeros)."""
    return b_cum if h_in is None else a_cum * h_in.unsqueeze(dim) + b_cum


def boundary_state(summaries: Tensor, rank: int, h0: Tensor | None) -> Tensor:
    """The state entering chunk ``rank``: summaries [N, 2, ...] (a_tot, b_tot per chunk) of chunks 0..rank-1
    applied to ``h0`` (None: zeros).

    The summaries of chunks rank.. are replaced by the identity map (1, 0) rather than left out, so every rank's
    result depends on the whole gathered tensor: the gather's backward, a collective, then runs on every rank.
    """
    before = (torch.arange(summaries.shape[0], device=summaries.device) < rank).view(-1, *[1] * (summaries.dim() - 2))
    a_tot = torch.where(before, summaries[:, 0], torch.ones_like(summaries[:, 0]))
    b_tot = torch.where(before, summaries[:, 1], torch.zeros_like(summaries[:, 1]))
    h = torch.zeros_like(b_tot[0]) if h0 is None else h0
    for index in range(summaries.shape[0]):
        h = a_tot[index] * h + b_tot[index]
    return h


class _AllGather(torch.autograd.Function):
    """all_gather with a gradient: each rank gets the sum over ranks of the gradients of its own slot."""

    @staticmethod
    def forward(ctx, tensor, group):  # noqa: D102
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        # Every rank's loss depends on every slot; reduce the full gradient, keep our slot. The payload is a
        # chunk summary (2·B·D values), so the simplicity of all_reduce over reduce_scatter costs nothing.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def linear_recurrence(a: Tensor, b: Tensor, h0: Tensor | None = None, group: dist.ProcessGroup | None = None,
                      dim: int = 1) -> Tensor:
    """All states h_t = a_t * h_{t-1} + b_t of this rank's chunk of a sequence split in time over ``group``.

    a, b: [..., T_local, ...] with time along ``dim``; h0: the state before the first step of the whole
    sequence ([..] without the time dim; zeros when None). Without a group (or a group of one) this is the
    single-process parallel scan. Chunks may have different lengths on different ranks.
    """
    a_cum, b_cum = associative_scan(a, b, dim)
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if size == 1:
        return apply_prefixes(a_cum, b_cum, h0, dim)
    summary = torch.stack([a_cum.select(dim, -1), b_cum.select(dim, -1)])
    gathered = _AllGather.apply(summary, group)  # [N, 2, ...]
    return apply_prefixes(a_cum, b_cum, boundary_state(gathered, dist.get_rank(group), h0), dim)


def simulate_chunked_scan(a: Tensor, b: Tensor, h0: Tensor | None, lengths: list[int], dim: int = 1) -> Tensor:
    """The cross-rank algorithm for virtual ranks holding consecutive chunks of ``lengths`` steps, in one process."""
    a_chunks, b_chunks = torch.split(a, lengths, dim=dim), torch.split(b, lengths, dim=dim)
    scans = [associative_scan(ac, bc, dim) for ac, bc in zip(a_chunks, b_chunks, strict=True)]
    summaries = torch.stack([torch.stack([ac.select(dim, -1), bc.select(dim, -1)]) for ac, bc in scans])
    return torch.cat([apply_prefixes(ac, bc, boundary_state(summaries, r, h0), dim)
                      for r, (ac, bc) in enumerate(scans)], dim=dim)

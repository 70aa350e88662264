"""Ring attention: exact causal attention over a sequence split in time across the ranks of a group.

Rank r of N holds the contiguous chunk of positions [r*c, (r+1)*c) of queries, keys and values (c = S/N).
Queries stay where they are; key/value blocks circulate N-1 steps around the ring (rank r sends to r+1 and
receives from r-1), and each rank folds every block it sees into running online-softmax statistics
(row maximum m, normalizer, unnormalized output acc), so the result equals dense causal attention up to
floating point. Under the causal mask a block whose every key lies after every query of this rank is fully
masked: it is skipped (and counted), never computed. With contiguous chunks rank r computes r+1 of its N
blocks, so the last rank does the most work; a zig-zag assignment would balance it (docs/parallel.md).

The backward pass is a second ring: key/value blocks circulate again together with their gradient
accumulators, each rank adds its queries' contribution, and one last step returns each block's accumulated
gradient to its owner. Bytes sent per rank: forward (N-1)·2·c·d per head and sequence; backward twice that
plus one more block of gradients.

The block arithmetic (:func:`fold_block`, :func:`block_gradients`) is shared by the distributed version and
by :func:`simulate_ring_attention`, which runs the same schedule for N virtual ranks in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass
class RingStats:
    """Counters of one or more ring-attention calls on this rank (for tests and the communication benchmark)."""

    blocks_computed: int = 0
    blocks_skipped: int = 0
    bytes_sent_forward: int = 0
    bytes_sent_backward: int = 0


@dataclass
class _Online:
    """Online-softmax state of a query chunk: running row max, normalizer and unnormalized output."""

    m: Tensor    # [..., Lq]
    norm: Tensor  # [..., Lq]
    acc: Tensor  # [..., Lq, d]

    @classmethod
    def empty(cls, q: Tensor) -> _Online:
        shape = q.shape[:-1]
        return cls(q.new_full(shape, -math.inf), q.new_zeros(shape), torch.zeros_like(q))

    def result(self) -> tuple[Tensor, Tensor]:
        """Normalized output [..., Lq, d] and log-sum-exp [..., Lq]."""
        return self.acc / self.norm.unsqueeze(-1), self.m + self.norm.log()


def _visibility(q_pos: range, k_pos: range) -> str:
    """'none' when every key is after every query, 'all' when every key is at or before every query, else 'some'.

    Positions are Python ranges, so deciding to skip a block never waits for a device.
    """
    if k_pos[0] > q_pos[-1]:
        return "none"
    if k_pos[-1] <= q_pos[0]:
        return "all"
    return "some"


def _scores(q: Tensor, k: Tensor, q_pos: range, k_pos: range, scale: float, visible: str) -> Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if visible == "some":
        rows = torch.arange(q_pos.start, q_pos.stop, device=q.device)
        cols = torch.arange(k_pos.start, k_pos.stop, device=q.device)
        scores = scores.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1), -math.inf)  # [Lq, Lk]: key after query
    return scores


def _sub_blocks(length: int, block_size: int | None) -> list[slice]:
    size = block_size or length
    return [slice(start, min(start + size, length)) for start in range(0, length, size)]


def fold_block(state: _Online, q: Tensor, q_pos: range, k: Tensor, v: Tensor, k_pos: range, scale: float,
               stats: RingStats, block_size: int | None = None) -> None:
    """Fold one key/value block (split into sub-blocks of ``block_size`` keys) into the online softmax state."""
    for part in _sub_blocks(k.shape[-2], block_size):
        visible = _visibility(q_pos, k_pos[part])
        if visible == "none":
            stats.blocks_skipped += 1
            continue
        stats.blocks_computed += 1
        scores = _scores(q, k[..., part, :], q_pos, k_pos[part], scale, visible)
        m_new = torch.maximum(state.m, scores.amax(dim=-1))
        # A row with no visible key yet has m = -inf; shifting by 0 instead keeps exp() at exactly 0, not NaN.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        probs = torch.exp(scores - shift.unsqueeze(-1))
        alpha = torch.exp(state.m - shift)
        state.norm = state.norm * alpha + probs.sum(dim=-1)
        state.acc = state.acc * alpha.unsqueeze(-1) + torch.matmul(probs, v[..., part, :])
        state.m = m_new


def block_gradients(q: Tensor, q_pos: range, k: Tensor, v: Tensor, k_pos: range, d_out: Tensor, lse: Tensor,
                    delta: Tensor, scale: float, stats: RingStats,
                    block_size: int | None = None) -> tuple[Tensor, Tensor, Tensor] | None:
    """Gradients (dq, dk, dv) of this query chunk's attention through one key/value block; None if masked.

    ``lse`` is the final log-sum-exp of the query rows and ``delta`` = rowsum(d_out * out), so the softmax
    probabilities are recomputed exactly as the forward pass normalized them.
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    touched = False
    for part in _sub_blocks(k.shape[-2], block_size):
        visible = _visibility(q_pos, k_pos[part])
        if visible == "none":
            stats.blocks_skipped += 1
            continue
        stats.blocks_computed += 1
        touched = True
        k_part, v_part = k[..., part, :], v[..., part, :]
        probs = torch.exp(_scores(q, k_part, q_pos, k_pos[part], scale, visible) - lse.unsqueeze(-1))
        dv[..., part, :] = torch.matmul(probs.transpose(-1, -2), d_out)
        d_scores = probs * (torch.matmul(d_out, v_part.transpose(-1, -2)) - delta.unsqueeze(-1))
        dq = dq + torch.matmul(d_scores, k_part) * scale
        dk[..., part, :] = torch.matmul(d_scores.transpose(-1, -2), q) * scale
    return (dq, dk, dv) if touched else None


def _positions(rank: int, chunk: int) -> range:
    return range(rank * chunk, (rank + 1) * chunk)


# ---------------------------------------------------------------------------------------------------------
# The real ring: torch.distributed point-to-point (gloo on CPU, NCCL on GPUs)
# ---------------------------------------------------------------------------------------------------------


def _shift_ring(tensor: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, list]:
    """Start sending ``tensor`` to the next rank of the group and receiving the previous rank's; (buffer, work)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    prv = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), nxt, group), dist.P2POp(dist.irecv, incoming, prv, group)]
    return incoming, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Causal attention over a time-partitioned sequence with a ring forward and a ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, block_size, stats):  # noqa: D102 - see ring_attention()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk, scale = q.shape[-2], q.shape[-1] ** -0.5
        q_pos = _positions(rank, chunk)
        state = _Online.empty(q)
        kv = torch.stack([k, v])
        for step in range(size):
            src = (rank - step) % size
            works = []
            if step < size - 1:  # overlap the next block's transfer with this block's arithmetic
                incoming, works = _shift_ring(kv, group)
                stats.bytes_sent_forward += kv.numel() * kv.element_size()
            fold_block(state, q, q_pos, kv[0], kv[1], _positions(src, chunk), scale, stats, block_size)
            if works:
                _wait(works)
                kv = incoming
        out, lse = state.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.block_size, ctx.stats = group, block_size, stats
        return out

    @staticmethod
    def backward(ctx, d_out):  # noqa: D102 - the ring backward of the module docstring
        q, k, v, out, lse = ctx.saved_tensors
        group, stats = ctx.group, ctx.stats
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk, scale = q.shape[-2], q.shape[-1] ** -0.5
        q_pos = _positions(rank, chunk)
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(dim=-1)
        dq = torch.zeros_like(q)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(size):
            src = (rank - step) % size
            grads = block_gradients(q, q_pos, kv[0], kv[1], _positions(src, chunk), d_out, lse, delta,
                                    scale, stats, ctx.block_size)
            if grads is not None:
                dq = dq + grads[0]
                dkv = dkv + torch.stack([grads[1], grads[2]])
            if size == 1:
                break
            # Blocks travel with their gradient accumulators; after the last step only the accumulators move,
            # one hop further, which lands each block's gradient on its owner.
            payload = torch.cat([kv, dkv]) if step < size - 1 else dkv
            incoming, works = _shift_ring(payload, group)
            stats.bytes_sent_backward += payload.numel() * payload.element_size()
            _wait(works)
            kv, dkv = (incoming[:2], incoming[2:]) if step < size - 1 else (kv, incoming)
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
                   block_size: int | None = None, stats: RingStats | None = None) -> Tensor:
    """Causal attention of this rank's chunk of a sequence split evenly in time over ``group``.

    q, k, v: [..., c, d], this rank's c consecutive positions (rank r holds positions r*c .. r*c+c-1). Returns
    [..., c, d], equal (up to floating point) to this rank's rows of dense causal attention over the whole
    sequence; differentiable (ring backward). ``block_size`` splits each key/value block into sub-blocks so
    the score matrix is at most c × block_size. ``stats`` accumulates block and byte counters.
    """
    return _RingAttention.apply(q, k, v, group, block_size, stats if stats is not None else RingStats())


# ---------------------------------------------------------------------------------------------------------
# The same schedule for N virtual ranks in one process (tests, documentation of the schedule)
# ---------------------------------------------------------------------------------------------------------


def simulate_ring_attention(q: Tensor, k: Tensor, v: Tensor, ranks: int, block_size: int | None = None,
                            d_out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None,
                                                                  list[RingStats]]:
    """Run the ring schedule for ``ranks`` virtual ranks over full tensors [..., S, d] (S divisible by ranks).

    At step s virtual rank r holds the key/value block of rank (r - s) mod N, exactly as on the real ring.
    Returns the output [..., S, d], the gradients (dq, dk, dv) of ``(out * d_out).sum()`` when ``d_out`` is
    given (computed by the ring backward's block rule, not by autograd), and per-rank counters.
    """
    seq = q.shape[-2]
    if seq % ranks:
        raise ValueError(f"sequence length {seq} is not divisible by {ranks} ranks")
    chunk, scale = seq // ranks, q.shape[-1] ** -0.5
    split = [lambda x, r=r: x[..., r * chunk:(r + 1) * chunk, :] for r in range(ranks)]
    stats = [RingStats() for _ in range(ranks)]
    outs, lses = [], []
    for r in range(ranks):
        state, q_pos = _Online.empty(split[r](q)), _positions(r, chunk)
        for step in range(ranks):
            src = (r - step) % ranks
            fold_block(state, split[r](q), q_pos, split[src](k), split[src](v), _positions(src, chunk),
                       scale, stats[r], block_size)
        out, lse = state.result()
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=-2)
    if d_out is None:
        return out, None, stats
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(ranks):
        rows = slice(r * chunk, (r + 1) * chunk)
        delta = (split[r](d_out) * outs[r]).sum(dim=-1)
        for step in range(ranks):
            src = (r - step) % ranks
            cols = slice(src * chunk, (src + 1) * chunk)
            grads = block_gradients(split[r](q), _positions(r, chunk), split[src](k), split[src](v),
                                    _positions(src, chunk), split[r](d_out), lses[r], delta, scale,
                                    stats[r], block_size)
            if grads is not None:
                dq[..., rows, :] += grads[0]
                dk[..., cols, :] += grads[1]
                dv[..., cols, :] += grads[2]
    return out, (dq, dk, dv), stats

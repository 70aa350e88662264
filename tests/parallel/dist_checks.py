"""Checks run by every rank of a real torchrun (gloo) process group; each rank writes its findings as JSON.

    torchrun --nproc_per_node=N tests/parallel/dist_checks.py CHECK OUT_DIR [args...]

The pytest side (test_dist_*.py) launches this and asserts on the JSON, so a failure shows the numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worldpipe.parallel.ring_attention import RingStats, ring_attention
from worldpipe.parallel.scan import linear_recurrence, sequential_scan


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_ring(rank: int, size: int, chunk: int, block_size: int, seed: int) -> dict:
    """Ring attention of this rank's chunk vs the same rows of dense causal attention, forward and backward."""
    gen = torch.Generator().manual_seed(seed)
    seq = size * chunk
    q, k, v = (torch.randn(2, 3, seq, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    d_out = torch.randn(2, 3, seq, 4, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dense = F.scaled_dot_product_attention(*full, is_causal=True)
    (dense * d_out).sum().backward()
    rows = slice(rank * chunk, (rank + 1) * chunk)
    local = [t[..., rows, :].clone().requires_grad_(True) for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, block_size=block_size or None, stats=stats)
    (out * d_out[..., rows, :]).sum().backward()
    return {
        "out": _max_diff(out.detach(), dense.detach()[..., rows, :]),
        "dq": _max_diff(local[0].grad, full[0].grad[..., rows, :]),
        "dk": _max_diff(local[1].grad, full[1].grad[..., rows, :]),
        "dv": _max_diff(local[2].grad, full[2].grad[..., rows, :]),
        "blocks_computed": stats.blocks_computed, "blocks_skipped": stats.blocks_skipped,
        "bytes_sent_forward": stats.bytes_sent_forward, "bytes_sent_backward": stats.bytes_sent_backward,
        "kv_block_bytes": 2 * local[1].numel() * local[1].element_size(),
    }


def check_scan(rank: int, size: int, lengths: list[int], seed: int) -> dict:
    """Cross-rank scan of this rank's chunk (chunks of unequal length) vs the sequential loop, with gradients."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    a = torch.rand(2, total, 3, generator=gen, dtype=torch.float64)
    b = torch.randn(2, total, 3, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, total, 3, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (a, b, h0)]
    ref = sequential_scan(full[0], full[1], full[2])
    (ref * weight).sum().backward()
    start = sum(lengths[:rank])
    rows = slice(start, start + lengths[rank])
    la, lb = a[:, rows].clone().requires_grad_(True), b[:, rows].clone().requires_grad_(True)
    lh0 = h0.clone().requires_grad_(True)
    out = linear_recurrence(la, lb, lh0, group=dist.group.WORLD)
    (out * weight[:, rows]).sum().backward()
    # h0 is an input of every rank's chunk: its full gradient is the sum over ranks.
    dh0 = lh0.grad.clone()
    dist.all_reduce(dh0)
    return {"out": _max_diff(out.detach(), ref.detach()[:, rows]), "da": _max_diff(la.grad, full[0].grad[:, rows]),
            "db": _max_diff(lb.grad, full[1].grad[:, rows]), "dh0": _max_diff(dh0, full[2].grad)}


def main(argv: list[str]) -> None:
    check, out_dir, *args = argv
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if check == "ring":
        result = check_ring(rank, size, int(args[0]), int(args[1]), int(args[2]))
    elif check == "scan":
        result = check_scan(rank, size, [int(x) for x in args[0].split(",")], int(args[1]))
    else:
        raise SystemExit(f"unknown check {check!r}")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

"""A sequence split in time over the ranks of a context-parallel group: which chunk is mine, and my neighbours.

Rank r of a group of N holds time steps [r*c, (r+1)*c) of every window (c = T/N). A model bound to a
partition runs its forward pass on its chunk only; attention reaches other chunks by ring exchange
(`ring_attention`), an affine recurrence by exchanged boundary states (`scan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from worldpipe.parallel.ring_attention import RingStats


@dataclass
class TimePartition:
    """This rank's place in a context-parallel group (size 1: the whole sequence, no communication)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    stats: RingStats = field(default_factory=RingStats)

    @property
    def is_split(self) -> bool:
        """True when the sequence is really cut (more than one rank)."""
        return self.size > 1

    def chunk(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's consecutive slice of ``tensor`` along time ``dim`` (the length must divide evenly)."""
        length = tensor.shape[dim]
        if length % self.size:
            raise ValueError(f"time length {length} is not divisible by the context-parallel degree {self.size}")
        step = length // self.size
        return tensor.narrow(dim, self.rank * step, step)

    def next_first(self, first: torch.Tensor) -> torch.Tensor:
        """The first time step of the next rank's chunk, given this rank's own first step ([B, ...]).

        The last rank has no successor and gets zeros (callers mask that step out). Data only: no gradient.
        """
        if not self.is_split:
            return torch.zeros_like(first)
        received = torch.zeros_like(first)
        ops = []
        if self.rank > 0:
            ops.append(dist.P2POp(dist.isend, first.detach().contiguous(),
                                  dist.get_global_rank(self.group, self.rank - 1), self.group))
        if self.rank < self.size - 1:
            ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(self.group, self.rank + 1), self.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received


"""Process-group runtime: who am I, how many are we, and the few collectives the trainer needs."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    """The process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on the rank that performs side effects (publishing, logging)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_size_from_env() -> int:
    """World size as torchrun announces it (1 when launched without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_runtime(backend: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Join the process group that torchrun set up (no-op for a single process)."""
    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_runtime() -> None:
    """Leave the process group if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(runtime: Runtime) -> None:
    """Wait for every rank."""
    if runtime.distributed:
        dist.barrier()


def all_reduce_sum(runtime: Runtime, values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks (returns the input on a single process)."""
    if runtime.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_rank(runtime: Runtime, flag: bool) -> bool:
    """True if the flag is set on any rank, so every rank takes the same branch."""
    if not runtime.distributed:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def group_runtime(group: dist.ProcessGroup | None = None) -> Runtime:
    """This process's place in ``group`` (default: the whole job), or a single process when none is initialized
    (a background writer's collectives run on a group of their own)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return Runtime(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=torch.device("cpu"))


def gather_objects(runtime: Runtime, obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's object, indexed by rank (in ``group``, whose runtime is ``runtime``), on every rank."""
    if not runtime.distributed:
        return [obj]
    gathered: list[object] = [None] * runtime.world_size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(runtime: Runtime, obj: object, group: dist.ProcessGroup | None = None) -> object:
    """Rank 0's object (rank 0 of ``group``, whose runtime is ``runtime``) on every rank."""
    if not runtime.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]

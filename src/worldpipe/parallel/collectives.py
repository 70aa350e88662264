"""Communication of a training step as it happens: bytes and calls of every collective this rank makes, counted
at the dispatcher and named as the layout forecast (:mod:`worldpipe.parallel.forecast`) names them.

Bytes are those of the largest tensor handed to the call: the full side of a gather or scatter, the tensor of an
all-reduce or a send. Receives are not counted (the sender's rank counts them).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Collective ops as the dispatcher sees them -> the forecast's names. Ops without a name here (DDP's own
# bookkeeping broadcasts) are kept under the op's name: measured, not predicted.
OP_NAMES = {"c10d.allreduce_.default": "all_reduce(gradients)",
            "c10d._allgather_base_.default": "all_gather(parameters)",
            "c10d._reduce_scatter_base_.default": "reduce_scatter(gradients)",
            "_c10d_functional.all_reduce.default": "all_reduce(activations)",
            "c10d.send.default": "send(kv ring)",
            "_c10d_functional.all_gather_into_tensor.default": "all_gather(activations)",
            "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter(activations)"}
# In a pipeline, sends carry stage boundaries and the eager all-reduce sums a stage over its replicas.
PIPELINE_OP_NAMES = {**OP_NAMES, "c10d.send.default": "send(stage activations)",
                     "c10d.allreduce_.default": "all_reduce(stage gradients)"}
# A one-value all-reduce (eager, or DTensor's functional one) is clipping's gradient norm (whole, or one
# parameter's squared norm), not gradients or activations.
GRADIENT_NORM = "all_reduce(gradient norm)"
_NOT_COMMUNICATION = ("wait_tensor", "_wrap_tensor", "recv")


def collective_name(op: str, largest: torch.Tensor, pipeline: bool) -> str:
    """The forecast's name of one call of ``op`` whose largest tensor argument is ``largest``."""
    if op in ("c10d.allreduce_.default", "_c10d_functional.all_reduce.default") and largest.numel() == 1:
        return GRADIENT_NORM
    return (PIPELINE_OP_NAMES if pipeline else OP_NAMES).get(op, op)


class CollectiveCounter(TorchDispatchMode):
    """Within the ``with`` block: bytes and calls per collective (:attr:`comm`), by the forecast's names."""

    def __init__(self, pipeline: bool = False) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.bytes: Counter[str] = Counter()
        self.rounds: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func)
        if op.startswith(("c10d.", "_c10d_functional.")) and not any(s in op for s in _NOT_COMMUNICATION):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            largest = max(tensors, key=lambda t: t.numel() * t.element_size())
            name = collective_name(op, largest, self.pipeline)
            self.bytes[name] += largest.numel() * largest.element_size()
            self.rounds[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def comm(self) -> dict[str, dict[str, int]]:
        """``{name: {"bytes": ..., "rounds": ...}}``, the forecast's shape of a step's communication."""
        return {name: {"bytes": self.bytes[name], "rounds": self.rounds[name]} for name in sorted(self.rounds)}

"""torchrun worker for the planner test: trains the smoke transformer two steps in each named layout and writes
rank 0's measured memory by category and the bytes and calls of every collective of the second step.

    torchrun --nproc-per-node 2 plan_worker.py OUT.json LAYOUT=STRATEGY,TP,CP[,sp][,rc] ...
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from worldpipe.models.transformer import CausalTransformer
from worldpipe.parallel.layout import build_layout
from worldpipe.parallel.memory import measure_memory
from worldpipe.parallel.runtime import init_runtime, shutdown_runtime

# Collective ops as the dispatcher sees them, named as the planner names them (broadcasts DDP makes for its
# own bookkeeping are kept under their op name, not predicted).
NAMES = {"c10d.allreduce_.default": "all_reduce(gradients)", "c10d._allgather_base_.default": "all_gather(parameters)",
         "c10d._reduce_scatter_base_.default": "reduce_scatter(gradients)",
         "_c10d_functional.all_reduce.default": "all_reduce(activations)", "c10d.send.default": "send(kv ring)",
         "_c10d_functional.all_gather_into_tensor.default": "all_gather(activations)",
         "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter(activations)"}


class CollectiveCounter(TorchDispatchMode):
    """Bytes (the largest tensor argument: the full side of a gather or scatter) and calls per collective."""

    def __init__(self):
        super().__init__()
        self.bytes, self.rounds = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func)
        if op.startswith(("c10d.", "_c10d_functional.")) and "wait_tensor" not in op and "_wrap_tensor" not in op:
            name = NAMES.get(op, op)
            if "recv" not in op:
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                self.bytes[name] += max(t.numel() * t.element_size() for t in tensors)
                self.rounds[name] += 1
        return func(*args, **(kwargs or {}))


def run_layout(runtime, strategy: str, tp: int, cp: int, options: list[str]) -> dict:
    torch.manual_seed(0)
    model = CausalTransformer(3, 1, width=16, heads=2, layers=1)
    layout = build_layout({"strategy": strategy, "tensor_parallel": tp, "context_parallel": cp,
                           "sequence_parallel": "sp" in options, "recompute": "rc" in options}, runtime)
    model = layout.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **layout.optimizer_kwargs)
    gen = torch.Generator().manual_seed(1)
    full = {"obs": torch.randn(8, 16, 3, generator=gen), "action": torch.randn(8, 16, 1, generator=gen),
            "reward": torch.randn(8, 16, generator=gen), "mask": torch.ones(8, 16)}
    rows = 8 // layout.dp_size
    batch = layout.shard_batch({k: v[layout.dp_rank * rows:(layout.dp_rank + 1) * rows] for k, v in full.items()})

    def loss():
        return model(batch["obs"], batch["action"], batch["reward"], batch["mask"], None)["total"]

    loss().backward()
    optimizer.step()
    optimizer.zero_grad()
    with CollectiveCounter() as counter:
        memory = measure_memory(model, optimizer, loss)
    return {"memory": memory, "comm": {k: {"bytes": counter.bytes[k], "rounds": counter.rounds[k]}
                                       for k in counter.rounds}}


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    runtime = init_runtime("gloo")
    results = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        strategy, tp, cp, *options = rest.split(",")
        results[name] = run_layout(runtime, strategy, int(tp), int(cp), options)
    if runtime.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    shutdown_runtime()


if __name__ == "__main__":
    main()

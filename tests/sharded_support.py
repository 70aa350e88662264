"""Running the sharded-checkpoint worker (tests/checkpoint/sharded_worker.py): under a real torchrun (the crash
and memory tests: a rank killed, a rank's resident memory), or on ranks forked from the test (the rest)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

from forked_ranks import run_on_ranks
from worldpipe.launch.torchrun import torchrun_argv

WORKER = Path(__file__).parent / "checkpoint" / "sharded_worker.py"
TIMEOUT_S = 240


def torchrun(env: dict, nproc: int, *args, fault: str | None = None,
             extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the worker on ``nproc`` gloo ranks; ``fault`` sets WORLDPIPE_CKPT_FAULT for every rank."""
    run_env = dict(env, OMP_NUM_THREADS="1", **(extra_env or {}))
    run_env.pop("WORLDPIPE_CKPT_FAULT", None)
    if fault:
        run_env["WORLDPIPE_CKPT_FAULT"] = fault
    cmd = torchrun_argv(nproc, [str(WORKER), *map(str, args)])
    # torchrun waits for its ranks and stops the others when one dies; the timeout bounds a hang.
    return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=TIMEOUT_S)


def on_forked_ranks(nproc: int, *args, tmp: Path) -> None:
    """The worker's ``run(args)`` on ``nproc`` gloo ranks forked from the test (no torchrun start-up)."""
    spec = importlib.util.spec_from_file_location("sharded_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    run_on_ranks(nproc, worker.run, [str(a) for a in args], tmp=tmp)


def fsdp_toy_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two FSDP2-sharded linear layers and their AdamW after one step (needs a process group)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    return model, opt

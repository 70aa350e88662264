"""Run a function on every rank of a real gloo process group, in processes forked from the test.

``run_on_ranks(nproc, fn, *args, tmp=...)`` forks ``nproc`` processes; each joins a gloo process group of
``nproc`` ranks (a ``FileStore`` under ``tmp``: no port to race for), with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``
set as torchrun sets them (so ``init_runtime`` finds the group it would have joined), calls ``fn(*args)`` and
sends back its result. torch and worldpipe are already imported in the test process, so a rank starts in
milliseconds instead of the seconds a torchrun (an agent and one fresh interpreter per rank) takes on 2 cores.

The ranks run the project's own code (the Trainer, the Checkpointer, the layouts) against a real process
group: only the way the processes are started differs from ``worldpipe train``. ``train_on_ranks(overrides)``
is ``worldpipe train OVERRIDES`` so: the config checked and recorded as the launcher does, then the body of a
torchrun worker on every rank. What torchrun and the launcher do besides (rendezvous, run lock, lifelines, exit
codes, signals, kills) is tested by the tests that launch them.

Each rank sets one intra-op thread first, as torchrun does for several ranks per node; it is also what makes a
fork safe here: an OpenMP thread pool the test process used does not exist in the fork, and a parallel region
with more than one thread would wait for it forever. A rank that raises sends its
traceback; the others are then stopped (they may wait in a collective for it) and the test fails with the
first traceback. A rank that dies without a word (a crash) fails the test with its exit status.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import multiprocessing
import os
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._inductor.config  # noqa: F401 - see below
import torch.distributed as dist

# What every rank would otherwise import on its own, imported once in the test process: the trainer (with
# torch.distributed.checkpoint and DTensor), and the part of Inductor that `torch.use_deterministic_algorithms`
# (Trainer.setup) imports on first use. On 2 shared cores that is ~10 s a rank.
import worldpipe.trainer.trainer  # noqa: F401
from worldpipe.core import numerics
from worldpipe.launch.local_run import record_config
from worldpipe.launch.preflight import check_data, checked_config, world_size_of
from worldpipe.trainer.main import train
from worldpipe.trainer.resume import preflight_resume

TIMEOUT_S = 240  # a broken collective fails the test instead of hanging the suite
_CONTEXT = multiprocessing.get_context("fork")


def _rank_main(rank: int, nproc: int, store_path: str, fn: Callable, args: tuple, conn) -> None:
    # A rank that crashes (a signal, not an exception) leaves its Python stack here for the test's failure.
    crash_log = open(_crash_log(store_path, rank), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=crash_log, all_threads=True)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1")
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank, world_size=nproc,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test, with its traceback
        result = ("error", f"rank {rank}:\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()
    if dist.is_initialized() and result[0] == "ok":
        dist.destroy_process_group()


def _crash_log(store_path: str, rank: int) -> str:
    return f"{store_path}-rank{rank}-crash.log"


def _crash_stack(store_path: str, rank: int) -> str:
    try:
        text = Path(_crash_log(store_path, rank)).read_text(errors="replace").strip()
    except OSError:
        return ""
    return f"\n{text}" if text else ""


def fork_after_collecting() -> int:
    """``os.fork()`` with the test process's garbage collected first and the rest frozen for the child (see
    :func:`run_on_ranks`); the parent unfreezes at once, the child never."""
    gc.collect()
    gc.freeze()
    pid = -1
    try:
        pid = os.fork()
        return pid
    finally:
        if pid != 0:  # the child keeps its inherited objects frozen
            gc.unfreeze()


def run_on_ranks(nproc: int, fn: Callable[..., Any], *args: Any, tmp: Path, timeout_s: float = TIMEOUT_S) -> list:
    """``[fn(*args) on rank 0, ..., on rank nproc-1]``, each run in its own forked process of one gloo group.

    ``fn`` and ``args`` are inherited by the fork (no pickling); results come back pickled.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / f"pg-store-{uuid.uuid4().hex}"  # a fresh file: a group's store must never be reused
    pipes, procs = [], []
    # The test process's garbage is collected here, and what is left is frozen for the forks: a rank that
    # collected cycles it inherited (objects of earlier tests: process groups, fake-tensor caches) died with
    # SIGSEGV inside the garbage collector (make test, 2026-12-06: the stack faulthandler wrote).
    gc.collect()
    gc.freeze()
    try:
        for rank in range(nproc):
            receive, send = _CONTEXT.Pipe(duplex=False)
            proc = _CONTEXT.Process(target=_rank_main, args=(rank, nproc, str(store), fn, args, send), daemon=True)
            proc.start()
            send.close()
            pipes.append(receive)
            procs.append(proc)
    finally:
        gc.unfreeze()
    results: list = [None] * nproc
    errors: list[str] = []
    try:
        for rank, (receive, proc) in enumerate(zip(pipes, procs, strict=True)):
            # After a rank's error the others may wait for it in a collective: give them a moment only.
            if not receive.poll(5 if errors else timeout_s):
                errors.append(f"rank {rank}: no result within {5 if errors else timeout_s} s")
                continue
            try:
                status, value = receive.recv()
            except EOFError:
                proc.join(10)
                errors.append(f"rank {rank}: died without a result (exit status {proc.exitcode})"
                              f"{_crash_stack(str(store), rank)}")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(value)
    finally:
        for proc in procs:
            proc.join(0 if errors else 30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for receive in pipes:
            receive.close()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return results


def train_on_ranks(overrides: list[str], tmp: Path) -> dict:
    """``worldpipe train OVERRIDES`` on ranks forked from the test; returns the run's completion record.

    As the launcher: the config composed and validated once (``checked_config``), the data and a resume's
    identity checked, the config recorded in RUN_DIR/hydra; then every rank runs
    :func:`worldpipe.trainer.main.train` on it, as a torchrun worker does. A numerics mode that pins variables
    needs a fresh process (the test process has computed already): such runs go through ``worldpipe train``.
    """
    cfg = checked_config(overrides)
    assert not numerics.pinned_variables(cfg.get("numerics")), "a pinned numerics mode needs `worldpipe train`"
    check_data(cfg)
    preflight_resume(cfg)
    record_config(cfg, overrides)
    run_on_ranks(world_size_of(cfg), train, cfg, True, tmp=tmp)
    return json.loads((Path(cfg.run_dir) / "train_done.json").read_text())

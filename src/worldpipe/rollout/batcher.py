"""The batcher: one worker thread that gathers queued rollout jobs into batches and runs them.

A batch closes when it holds ``max_batch`` jobs or ``max_wait_s`` has passed since its first job arrived;
``max_batch=1`` serves every request alone (the no-batching baseline). Jobs of different models or state
shapes may share a batch: :func:`worldpipe.rollout.engine.run_jobs` splits them into compatible groups.

Test hook: with ``WORLDPIPE_SERVE_HOLD=DIR``, while the file ``DIR/hold`` exists the worker writes ``DIR/held``
before running a batch and waits until ``DIR/hold`` is removed, so a test can act (close a session, send
SIGTERM) while a request is in flight.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from worldpipe.rollout.engine import JobResult, RolloutJob, run_jobs
from worldpipe.rollout.padding import padded

log = logging.getLogger("worldpipe.rollout")

HOLD_ENV = "WORLDPIPE_SERVE_HOLD"
_STOP = object()


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch closes: at ``max_batch`` jobs or ``max_wait_s`` after its first job."""

    max_batch: int = 16
    max_wait_s: float = 0.002


@dataclass
class _Queued:
    job: RolloutJob
    future: Future
    enqueued: float
    alone: bool = False


class Batcher:
    """Runs submitted jobs on a worker thread, batched by :class:`BatchPolicy`."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._threads = torch.get_num_threads()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="rollout-batcher", daemon=True)
        self.batches = self.jobs = self.rows_computed = 0
        self._thread.start()

    def submit(self, job: RolloutJob, alone: bool = False) -> Future:
        """Queue ``job``; the future resolves to its :class:`JobResult` (timing: queue_s, model_s, batch).

        ``alone`` runs it in a batch of its own without waiting for others (warm-up).
        """
        future: Future = Future()
        self._queue.put(_Queued(job, future, time.perf_counter(), alone))
        return future

    def close(self) -> None:
        """Finish every queued job, then stop the worker."""
        self._queue.put(_STOP)
        self._thread.join()

    def _gather(self, first: _Queued) -> tuple[list[_Queued], bool]:
        batch, deadline = [first], time.perf_counter() + self.policy.max_wait_s
        while len(batch) < self.policy.max_batch:
            remaining = deadline - time.perf_counter()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _work(self) -> None:
        # The intra-op thread count is per OS thread (OpenMP): without this the worker would use every core,
        # and spinning OpenMP threads on a busy machine slow each step by orders of magnitude.
        torch.set_num_threads(self._threads)
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                break
            batch, stopping = ([first], False) if first.alone else self._gather(first)
            self._run(batch)
            # The futures now own the results; holding the batch here would keep its states alive until the
            # next batch (a leak the session tests measure).
            first = batch = None

    def _run(self, batch: list[_Queued]) -> None:
        _hold()
        started = time.perf_counter()
        try:
            results = run_jobs([item.job for item in batch])
        except Exception as exc:  # a bug must fail these requests, not kill the worker
            log.exception("rollout batch failed")
            for item in batch:
                item.future.set_exception(exc)
            return
        model_s = time.perf_counter() - started
        self.batches += 1
        self.jobs += len(batch)
        self.rows_computed += padded(len(batch))
        for item, result in zip(batch, results, strict=True):
            result.timing = {"queue_s": started - item.enqueued, "model_s": model_s, "batch": len(batch)}
            item.future.set_result(result)


def _hold() -> None:
    folder = os.environ.get(HOLD_ENV)
    if not folder:
        return
    hold = Path(folder, "hold")
    if not hold.exists():
        return
    Path(folder, "held").touch()
    while hold.exists():
        time.sleep(0.01)


__all__ = ["BatchPolicy", "Batcher", "JobResult"]

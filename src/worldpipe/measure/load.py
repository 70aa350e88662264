"""Open-loop load: Poisson arrivals at a fixed offered rate, latency and achieved throughput measured together.

Open loop means a request is sent at its scheduled arrival time whether or not earlier ones have finished, and
its latency is counted from that scheduled time (a late sender is queueing the client did, not free time):
past the service's capacity the queue, and so the latency, grows instead of the load quietly dropping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PERCENTILES = (50, 95, 99)


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> np.ndarray:
    """Arrival offsets (s) of a Poisson process with ``rate`` per second over ``duration_s``."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.5) + 16)
    times = np.cumsum(gaps)
    return times[times < duration_s]


def latency_summary(latencies: list[float]) -> dict:
    """p50/p95/p99 and mean in milliseconds (None when there are no samples)."""
    if not latencies:
        return {f"p{p}_ms": None for p in PERCENTILES} | {"mean_ms": None}
    values = np.asarray(latencies) * 1e3
    return {f"p{p}_ms": float(np.percentile(values, p)) for p in PERCENTILES} | {"mean_ms": float(values.mean())}


def run_open_loop(send: Callable[[int], None], rate: float, duration_s: float, drain_s: float = 10.0,
                  workers: int = 256, seed: int = 0) -> dict:
    """Offer ``rate`` requests/s for ``duration_s``; ``send(i)`` performs request i (raises on failure).

    Returns offered and achieved rates, latency percentiles over completed requests, and how many failed or
    had not finished ``drain_s`` after the last arrival (counted, never silently dropped).
    """
    arrivals = poisson_arrivals(rate, duration_s, seed)
    latencies: list[float] = []
    failures = []
    lock = threading.Lock()
    done_at: list[float] = []

    def one(i: int, scheduled: float) -> None:
        try:
            send(i)
        except Exception as exc:  # counted and reported, not raised: the load must go on
            with lock:
                failures.append(repr(exc))
            return
        finished = time.perf_counter()
        with lock:
            latencies.append(finished - scheduled)
            done_at.append(finished)

    pool = ThreadPoolExecutor(workers, thread_name_prefix="load")
    start = time.perf_counter() + 0.05
    for i, offset in enumerate(arrivals):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pool.submit(one, i, start + offset)
    deadline = start + duration_s + drain_s
    while time.perf_counter() < deadline and len(latencies) + len(failures) < len(arrivals):
        time.sleep(0.01)
    with lock:
        completed, failed = list(latencies), list(failures)
        window_done = sum(1 for t in done_at if t <= start + duration_s)
    pool.shutdown(wait=False, cancel_futures=True)
    return {"offered_rps": rate, "sent": int(len(arrivals)), "completed": len(completed), "failed": len(failed),
            "unfinished": int(len(arrivals)) - len(completed) - len(failed),
            "achieved_rps": window_done / duration_s, "goodput_rps": len(completed) / duration_s,
            **latency_summary(completed), "first_failure": failed[0] if failed else None}

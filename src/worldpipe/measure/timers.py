"""Timers with named boundaries: a span per part of a request, and critical-path accounting when they overlap.

A :class:`Timeline` records (name, start, end) spans on one clock (``time.perf_counter``). Parts of a serial
control loop happen one after another, so their durations add up to the wall time; where parts overlap (e.g.
input preparation of the next request during model work of this one), :meth:`Timeline.critical_path` charges
each instant of wall time to exactly one part: the one that started last among those running, so the
per-part totals always sum to the wall time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Timeline:
    """Named spans on the perf_counter clock."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)

    @contextmanager
    def part(self, name: str):
        """Record the enclosed block as a span named ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((name, start, time.perf_counter()))

    def add(self, name: str, start: float, end: float) -> None:
        """Record a span measured elsewhere (e.g. reported by the server, placed on this clock)."""
        self.spans.append((name, start, end))

    def totals(self) -> dict[str, float]:
        """Summed duration per part (overlaps counted in every part)."""
        out: dict[str, float] = defaultdict(float)
        for name, start, end in self.spans:
            out[name] += end - start
        return dict(out)

    def critical_path(self) -> dict[str, float]:
        """Wall time charged to one part per instant (the latest-started running span); sums to the wall time."""
        edges = sorted({t for _, s, e in self.spans for t in (s, e)})
        out: dict[str, float] = defaultdict(float)
        for lo, hi in zip(edges, edges[1:], strict=False):
            running = [(s, name) for name, s, e in self.spans if s <= lo and e >= hi]
            out[max(running)[1] if running else "idle"] += hi - lo
        return dict(out)


class PartClock:
    """Seconds per named part of a loop: each :meth:`lap` charges the time since the previous lap to a part.

    Cheap enough to run always (one ``perf_counter`` per lap); the laps of a loop body cover it end to end, so
    the parts sum to the loop's wall time. :meth:`summary` adds the process's CPU time over the same span (all
    threads): wall time well above CPU time is time spent waiting.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.start = self.last = time.perf_counter()
        self.cpu_start = time.process_time()

    def lap(self, part: str) -> None:
        """Charge the time since the previous lap (or the start) to ``part``."""
        now = time.perf_counter()
        self.totals[part] += now - self.last
        self.last = now

    def summary(self) -> dict[str, float | dict[str, float]]:
        """Wall and process CPU seconds since the start, and the seconds per part."""
        return {"wall_s": self.last - self.start, "cpu_s": time.process_time() - self.cpu_start,
                "parts_s": dict(self.totals)}

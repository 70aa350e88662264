"""Which old checkpoints to delete after a new one is durable."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def select_deletions(steps: Iterable[int], current: int, keep_last: int, keep_every: int | None,
                     is_intact: Callable[[int], bool]) -> list[int]:
    """Steps to delete after ``current`` was published.

    Kept: ``current``; the ``keep_last - 1`` newest older steps that are intact (so ``keep_last`` intact
    checkpoints remain to fall back on); older steps that are multiples of ``keep_every``; and every step newer
    than ``current`` (those belong to a run that was resumed from an earlier step; deleting them is not
    retention's call). Everything else older than ``current`` is deleted, oldest first.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    older = sorted((s for s in set(steps) if s < current), reverse=True)
    keep: set[int] = set()
    remaining = keep_last - 1
    for step in older:
        if remaining <= 0:
            break
        if is_intact(step):
            keep.add(step)
            remaining -= 1
    if keep_every:
        keep.update(s for s in older if s % keep_every == 0)
    return sorted(s for s in older if s not in keep)

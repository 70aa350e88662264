"""Rounds of contenders: every contender runs once per round, in an order that rotates from round to round.

Load drift on a shared machine and caches that warm up over a benchmark then hit every contender alike; each
contender is summarized by the median over rounds of its per-round mean (one value per round is its own mean).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

Spec = TypeVar("Spec")
Sample = TypeVar("Sample")


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """``names`` starting at position ``round_`` (mod their count), wrapping around."""
    shift = round_ % len(names)
    return [*names[shift:], *names[:shift]]


def run_rounds(rounds: int, contenders: Callable[[int], Mapping[str, Spec]],
               measure: Callable[[str, Spec, int], Sample]) -> dict[str, list[Sample]]:
    """``measure(name, spec, round)`` of every contender in every round; samples by name, in round order.

    ``contenders(round)`` gives that round's specs (fresh run directories, say); names keep the first round's
    order in the result.
    """
    samples: dict[str, list[Sample]] = {name: [] for name in contenders(0)}
    for round_ in range(rounds):
        specs = contenders(round_)
        for name in rotated(list(specs), round_):
            samples.setdefault(name, []).append(measure(name, specs[name], round_))
    return samples


def median_of_means(rounds: Iterable[float | Iterable[float]]) -> float:
    """Median over rounds of each round's mean (a number is a round of one value, or its mean already)."""
    return statistics.median(float(r) if isinstance(r, int | float) else statistics.fmean(r) for r in rounds)

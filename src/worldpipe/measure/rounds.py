"""Rounds of contenders: every contender runs once per round, in an order that changes from round to round.

The orders are the rows of a Williams design: over n rounds (2n when n is odd) every contender runs once in
every position and right after every other contender equally often. Load drift on a shared machine, caches that
warm up over a benchmark, and what a run leaves behind for the next one (a busy disk, a cold or warm page cache)
then hit every contender alike; a plain rotation would have kept each contender behind the same neighbour in
every round. Each contender is summarized by the median over rounds of its per-round mean (one value per round
is its own mean).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

Spec = TypeVar("Spec")
Sample = TypeVar("Sample")


def round_order(names: Sequence[str], round_: int) -> list[str]:
    """``names`` in the order of round ``round_``: row ``round_`` of a Williams design over them (cycling)."""
    count = len(names)
    first, low, high = [0], 1, count - 1  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    row = round_ % (2 * count if count % 2 else count)
    order = [(i + row) % count for i in first]
    if row >= count:  # odd count: the mirrored rows give every ordered pair of neighbours its turn
        order = [(i + row - count) % count for i in first][::-1]
    return [names[i] for i in order]


def run_rounds(rounds: int, contenders: Callable[[int], Mapping[str, Spec]],
               measure: Callable[[str, Spec, int], Sample]) -> dict[str, list[Sample]]:
    """``measure(name, spec, round)`` of every contender in every round; samples by name, in round order.

    ``contenders(round)`` gives that round's specs (fresh run directories, say); names keep the first round's
    order in the result.
    """
    samples: dict[str, list[Sample]] = {name: [] for name in contenders(0)}
    for round_ in range(rounds):
        specs = contenders(round_)
        for name in round_order(list(specs), round_):
            samples.setdefault(name, []).append(measure(name, specs[name], round_))
    return samples


def median_of_means(rounds: Iterable[float | Iterable[float]]) -> float:
    """Median over rounds of each round's mean (a number is a round of one value, or its mean already)."""
    return statistics.median(float(r) if isinstance(r, int | float) else statistics.fmean(r) for r in rounds)

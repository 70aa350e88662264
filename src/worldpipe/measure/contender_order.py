"""Rounds of contenders: every contender runs once per round, in an order that changes from round to round.

The orders are the rows of a Williams design: over n rounds (2n when n is odd) every contender runs once in
every position and right after every other contender equally often. Load drift on a shared machine, caches that
warm up over a benchmark, and what a run leaves behind for the next one (a busy disk, a cold or warm page cache)
then hit every contender alike; a plain rotation would have kept each contender behind the same neighbour in
every round. Each contender is summarized by the median over rounds of its per-round mean (one value per round
is its own mean).
"""

from __future__ import annotations

import math
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


def median_interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample: ``(low, high, coverage)``.

    The k-th smallest and k-th largest values, k as large as keeps the coverage (the chance that the interval
    holds the median, for independent rounds of any distribution) at ``confidence`` or more. With too few values
    for that, the smallest and the largest, with the coverage they have (3 rounds: 0.75).
    """
    ordered = sorted(float(v) for v in values)
    count = len(ordered)
    if count == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:  # 1 - 2 P(Binomial(count, 1/2) <= k - 1)
        return 1 - 2 * sum(math.comb(count, i) for i in range(k)) / 2 ** count

    k = 1
    while k + 1 <= (count + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[count - k], coverage(k)

"""Rounds of benchmark contenders (worldpipe.measure.rounds): a balanced order, sample order, median of round means."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from worldpipe.measure.rounds import median_of_means, round_order, run_rounds


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7])
def test_each_contender_runs_in_every_position_and_after_every_other_equally_often(count):
    names = [f"c{i}" for i in range(count)]
    cycle = 2 * count if count % 2 else count
    orders = [round_order(names, r) for r in range(cycle)]
    assert all(sorted(o) == names for o in orders)
    assert orders[0][0] == names[0] and round_order(names, cycle) == orders[0]
    positions = Counter((name, o.index(name)) for o in orders for name in names)
    assert set(positions.values()) == {cycle // count}
    neighbours = Counter((o[i], o[i + 1]) for o in orders for i in range(count - 1))
    if count > 1:
        assert len(neighbours) == count * (count - 1)  # every ordered pair...
        assert len(set(neighbours.values())) == 1  # ...equally often


def test_run_rounds_measures_each_contender_once_per_round_in_the_rounds_order():
    calls = []

    def contenders(round_):
        return {name: f"{name}-dir-{round_}" for name in ("a", "b", "c")}

    def measure(name, spec, round_):
        calls.append((round_, name))
        return len(calls)

    samples = run_rounds(3, contenders, measure)
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert list(samples) == ["a", "b", "c"]  # the first round's order, whatever ran first later
    assert samples == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}


def test_median_of_means_takes_each_rounds_mean_then_the_median():
    assert median_of_means([np.array([1.0, 2.0]), np.array([3.0, 5.0]), np.array([10.0])]) == 4.0
    assert median_of_means([2.5, 0.5, 9.0, 1.5]) == 2.0  # numbers are rounds of one value; even count: midpoint

"""Rounds of benchmark contenders (worldpipe.measure.contender_order): a balanced order, sample order, median of round means."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from worldpipe.measure.contender_order import median_interval, median_of_means, round_order, run_rounds


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


def test_the_median_interval_takes_order_statistics_with_the_coverage_asked():
    # 10 rounds: the 2nd smallest and 2nd largest cover the median with chance 1 - 2 * 11/1024 = 0.979; the 3rd
    # pair only 0.891, short of 0.9.
    low, high, coverage = median_interval([7, 1, 9, 3, 5, 2, 10, 4, 8, 6])
    assert (low, high) == (2, 9) and coverage == pytest.approx(1 - 22 / 1024)
    assert median_interval(range(1, 11), confidence=0.85)[:2] == (3, 8)
    assert median_interval([3, 1, 2, 5, 4])[:2] == (1, 5)  # 5 rounds: the extremes, 0.9375
    low, high, coverage = median_interval([2.0, 1.0, 3.0])  # too few for 0.9: the extremes, saying so
    assert (low, high) == (1.0, 3.0) and coverage == pytest.approx(0.75)
    assert median_interval([4.0]) == (4.0, 4.0, 0.0)
    with pytest.raises(ValueError):
        median_interval([])

"""Rounds of benchmark contenders (worldpipe.measure.rounds): rotation, sample order, median of round means."""

from __future__ import annotations

import numpy as np

from worldpipe.measure.rounds import median_of_means, rotated, run_rounds


def test_every_contender_leads_one_round_in_turn():
    names = ["bare", "trainer", "tracked"]
    orders = [rotated(names, r) for r in range(4)]
    assert [o[0] for o in orders] == ["bare", "trainer", "tracked", "bare"]
    assert all(sorted(o) == sorted(names) for o in orders)


def test_run_rounds_measures_each_contender_once_per_round_in_rotated_order():
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

"""Comparing metric histories: first differing step and metric, duplicates."""

import math

from worldpipe.tracking.history import duplicate_steps, first_difference


def test_identical_histories_have_no_difference_and_timing_is_ignored():
    a = {"loss/total": [(5, 1, 0.5), (10, 2, 0.25)], "step_time_s": [(5, 1, 0.1)]}
    b = {"loss/total": [(5, 9, 0.5), (10, 9, 0.25)], "step_time_s": [(5, 9, 0.2)]}
    assert first_difference(a, b) is None


def test_first_difference_is_the_earliest_step_then_metric_name():
    a = {"lr": [(5, 0, 1.0), (10, 0, 2.0)], "loss/kl": [(5, 0, 0.1), (10, 0, 0.3)]}
    b = {"lr": [(5, 0, 1.0), (10, 0, 2.5)], "loss/kl": [(5, 0, 0.1), (10, 0, 0.4)]}
    assert first_difference(a, b) == (10, "loss/kl", 0.3, 0.4)


def test_missing_steps_and_metrics_are_differences_nan_equals_nan():
    assert first_difference({"x": [(1, 0, 1.0)]}, {"x": [(1, 0, 1.0), (2, 0, 3.0)]}) == (2, "x", None, 3.0)
    assert first_difference({"x": [(1, 0, 1.0)], "y": [(1, 0, 2.0)]}, {"x": [(1, 0, 1.0)]}) == (1, "y", 2.0, None)
    assert first_difference({"x": [(1, 0, math.nan)]}, {"x": [(1, 5, math.nan)]}) is None


def test_duplicate_steps():
    assert duplicate_steps({"a": [(1, 0, 1.0), (1, 1, 1.0), (2, 0, 1.0)], "b": [(1, 0, 0.0)]}) == {"a": [1]}


def test_evaluations_logged_on_the_run_afterwards_are_not_part_of_its_training_history():
    trained = {"loss/total": [(40, 0, 0.5)]}
    evaluated = {**trained, "eval/ratio_h8": [(40, 0, 0.3)], "control/behaviour/return_ci95_high": [(40, 0, -46.5)],
                 "control/score": [(40, 0, 0.9)]}
    assert first_difference(evaluated, trained) is None
    assert first_difference({**evaluated, "loss/kl": [(40, 0, 1.0)]}, trained) == (40, "loss/kl", 1.0, None)

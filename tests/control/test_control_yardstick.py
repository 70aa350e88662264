"""The yardstick: scores from random (0) to the ceiling (1), the budget curve that picks the ceiling, and the
record a closed-loop evaluation keeps of both (real Gymnasium Pendulum-v1 episodes, the true simulator)."""

from __future__ import annotations

import json

import pytest

from worldpipe.config.paths import conf_dir
from worldpipe.config.planner import planner_config
from worldpipe.control.evaluation import (
    BEST_KNOWN,
    HTTP_CONTENDER,
    ControlSettings,
    control_result,
    record_differences,
    score,
)
from worldpipe.control.yardstick import budget_curve, budget_levels, choose_level, plot_budget_curve


def test_a_score_runs_from_random_to_the_ceiling_and_says_why_when_they_meet():
    assert score(-200.0, floor=-1200.0, ceiling=-200.0) == (1.0, None)
    assert score(-700.0, floor=-1200.0, ceiling=-200.0) == (0.5, None)
    assert score(-150.0, floor=-1200.0, ceiling=-200.0)[0] == pytest.approx(1.05)  # better than the ceiling: > 1
    value, reason = score(-3.0, floor=-7.0, ceiling=-7.0)
    assert value is None and "equals random's" in reason and "more episodes" in reason


def test_budget_levels_double_samples_and_iterations_together():
    assert budget_levels(128, 1, 3) == [{"samples": 128, "iterations": 1}, {"samples": 256, "iterations": 2},
                                        {"samples": 512, "iterations": 4}]
    with pytest.raises(ValueError, match="at least 2 levels"):
        budget_levels(128, 1, 1)


def test_the_ceiling_is_the_first_level_no_later_level_beats_on_the_same_seeds():
    noise = [0.5, -0.5, 1.0, -1.0, 0.0]
    base = [-300.0, -200.0, -150.0, -400.0, -250.0]  # mean -260; random -1260: a scale of 1000
    better = [r + 20 + d for r, d in zip(base, noise, strict=True)]  # +20 on every seed: 2% of the scale
    same = [r + d for r, d in zip(better, noise[::-1], strict=True)]  # noise, no gain
    assert choose_level([base, better, same], random=-1260.0) == 1
    assert choose_level([better, same, same], random=-1260.0) == 0
    # A gain that only shows two doublings later still counts against the earlier level.
    assert choose_level([base, [r + d for r, d in zip(base, noise, strict=True)], better], random=-1260.0) == 2
    # +3 on every seed is certain but immaterial (0.3% of the scale): the cheaper level stays the ceiling.
    slightly = [r + 3 + d / 10 for r, d in zip(base, noise, strict=True)]
    assert choose_level([base, slightly], random=-1260.0) == 0
    assert choose_level([base, slightly], random=-1260.0, material=0.0) == 1


def test_a_budget_curve_with_the_true_simulator_on_held_out_seeds(tmp_path):
    planner = planner_config("mppi", ["samples=8", "horizon=4", "iterations=1"], conf_dir())
    curve = budget_curve("Pendulum-v1", planner, episodes=3, max_steps=15, seed=5000, levels=2)
    assert [(p["samples"], p["iterations"]) for p in curve["levels"]] == [(8, 1), (16, 2)]
    assert all(len(p["returns"]) == 3 and p["ci95"][0] <= p["mean"] <= p["ci95"][1] for p in curve["levels"])
    assert "gain_over_previous" in curve["levels"][1] and "gain_over_previous" not in curve["levels"][0]
    chosen = curve["levels"][curve["chosen_level"]]
    assert curve["ceiling_overrides"] == [f"samples={chosen['samples']}", f"iterations={chosen['iterations']}"]
    assert curve["random"]["episodes"] == 3 and curve["random"]["mean"] < chosen["mean"]
    assert curve["best_known"] == BEST_KNOWN["Pendulum-v1"]
    json.dumps(curve)  # the JSON the rule writes
    plot_budget_curve(curve, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def _contender(returns: list[float], sha: str = "a") -> dict:
    steps = {part: [0.001] * 3 for part in ("capture", "prepare", "transport", "model", "output", "decision",
                                              "actuation")}
    return {"returns": returns, "actions_sha256": [sha * 64] * len(returns), "energy": {"reason": "none here"},
            "timings": [steps] * len(returns)}


def _record(contenders: dict) -> dict:
    settings = ControlSettings("Pendulum-v1", "noisy_controller", 3, 2, 5000, 4, {"samples": 8, "iterations": 1},
                               1, {"samples": 32, "iterations": 4, "horizon": 5})
    return control_result(settings, {"step": 10, "config": {}}, "d" * 64, 0, contenders)


def test_the_record_scores_every_contender_against_the_ceiling_beside_the_best_known_return():
    record = _record({"random": _contender([-1200.0, -1000.0]), "behaviour": _contender([-190.0, -170.0]),
                      "planner": _contender([-300.0, -200.0]), "ceiling": _contender([-200.0, -180.0])})
    assert record["ceiling_score"] == 1.0 and record["contenders"]["random"]["score"] == 0.0
    assert record["score"] == pytest.approx((-250.0 + 1100.0) / (-190.0 + 1100.0))
    assert record["behaviour_score"] == pytest.approx((-180.0 + 1100.0) / 910.0)
    yardstick = record["yardstick"]
    assert yardstick["floor_return"] == -1100.0 and yardstick["ceiling_return"] == -190.0
    assert yardstick["ceiling_budget"] == {"samples": 32, "iterations": 4, "horizon": 5}
    assert yardstick["no_score_reason"] is None
    assert yardstick["best_known"]["return"] == -150.0 and yardstick["best_known"]["score"] > 1
    assert "http_probe" not in record and "http_takes_the_in_process_actions" not in record


def test_a_ceiling_that_ties_random_leaves_no_score_and_says_why():
    record = _record({"random": _contender([-5.0, -5.0]), "behaviour": _contender([-4.0, -4.0]),
                      "planner": _contender([-4.5, -4.5]), "ceiling": _contender([-5.0, -5.0])})
    assert record["score"] is None and record["ceiling_score"] is None and record["behaviour_score"] is None
    assert "equals random's" in record["yardstick"]["no_score_reason"]
    json.dumps(record, allow_nan=False)


def test_the_http_run_is_a_latency_probe_beside_the_contenders_not_one_of_them():
    record = _record({"random": _contender([-1200.0, -1000.0]), "behaviour": _contender([-190.0, -170.0]),
                      "planner": _contender([-300.0, -200.0], "p"), "ceiling": _contender([-200.0, -180.0]),
                      HTTP_CONTENDER: _contender([-300.0], "p")})
    assert set(record["contenders"]) == {"random", "behaviour", "planner", "ceiling"}
    probe = record["http_probe"]
    assert probe["episodes"] == 1 and probe["takes_the_in_process_actions"] is True
    assert record["http_takes_the_in_process_actions"] is True
    assert "mean" not in probe and "score" not in probe and probe["control_loop"]["steps"] == 3
    changed = json.loads(json.dumps(record))
    changed["http_probe"]["actions_sha256"] = ["0" * 64]
    assert record_differences(changed, record) == ["http_probe: actions over HTTP differ"]


def test_mlflow_gets_every_score_and_the_http_probe_as_timing_only():
    from worldpipe.tracking.evaluation import CLOCK_METRICS, control_summaries

    record = _record({"random": _contender([-1200.0, -1000.0]), "behaviour": _contender([-190.0, -170.0]),
                      "planner": _contender([-300.0, -200.0]), "ceiling": _contender([-200.0, -180.0]),
                      HTTP_CONTENDER: _contender([-300.0])})
    metrics = control_summaries(record)
    assert {"control/score", "control/ceiling_score", "control/behaviour_score"} <= set(metrics)
    assert metrics["control/score"] == record["score"] and metrics["control/ceiling_score"] == 1.0
    assert set(CLOCK_METRICS) <= set(metrics)
    assert not [key for key in metrics if "planner_http" in key or ("http_probe" in key and "decision" not in key)]

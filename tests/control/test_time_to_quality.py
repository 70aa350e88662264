"""Time to quality across loop seeds: per round the median return over loops with a bootstrap CI that the same
summaries always give, when each loop reached the ceiling's CI, the anchors of the env, and the figure."""

from __future__ import annotations

import json

import pytest

from worldpipe.control.time_to_quality import (
    median_ci,
    plot_time_to_quality,
    reached_quality,
    summarize_loops,
    table,
)


def loop(returns: list[float], seconds: float) -> dict:
    rows = [{"round": k, "env_steps": 400 * (k + 1), "return_mean": r, "return_ci95": [r - 50, r + 50],
             "loop_wall_clock_s": seconds * (k + 1),
             "wall_clock_s": {"collection": 1.0, "training": seconds - 1.0, "evaluation": 20.0}}
            for k, r in enumerate(returns)]
    return {"rounds": rows, "env_id": "Pendulum-v1", "experiment": "pendulum_scratch", "seeds": 10,
            "random": {"mean": -1200.0, "ci95": [-1300.0, -1100.0]},
            "ceiling": {"mean": -180.0, "ci95": [-230.0, -130.0]}, "behaviour_policy": "random"}


LOOPS = [loop([-1100, -400, -200], 30), loop([-900, -250, -150], 40), loop([-1000, -600, -240], 35),
         loop([-1150, -180, -170], 50), loop([-1200, -700, -500], 45)]


def test_the_median_and_its_interval_come_from_the_loops_and_repeat():
    summary = summarize_loops(LOOPS)
    last = summary["rounds"][-1]
    assert last["returns"] == [-200, -150, -240, -170, -500] and last["return"]["median"] == -200
    low, high = last["return"]["ci95"]
    assert -500 <= low <= -200 <= high <= -150
    assert summarize_loops(LOOPS)["rounds"][-1]["return"] == last["return"]  # a fixed generator: the same CI
    assert last["env_steps_median"] == 1200 and last["loop_wall_clock_median_s"] == 120
    assert last["wall_clock_split_median_s"] == {"collection": 1.0, "training": 39.0, "evaluation": 20.0}
    assert median_ci([3.0]) == {"median": 3.0, "ci95": [3.0, 3.0], "n": 1}


def test_quality_is_the_first_round_inside_the_ceilings_interval():
    assert reached_quality(LOOPS[0]) == {"round": 2, "env_steps": 1200, "loop_wall_clock_s": 90}
    assert reached_quality(LOOPS[3])["round"] == 1
    assert reached_quality(LOOPS[4]) is None
    summary = summarize_loops(LOOPS)
    assert summary["quality"]["loops_reached"] == 3 and summary["quality"]["env_steps_median"] == 1200


def test_the_table_and_figure_carry_the_anchors(tmp_path):
    summary = summarize_loops(LOOPS)
    assert [a["agent"] for a in summary["anchors"]] == ["TD3", "SAC", "PPO", "PETS-style budget"]
    assert "| 2 | 1200 | -200.0 [" in table(summary)
    plot_time_to_quality(summary, tmp_path / "ttq.png")
    assert (tmp_path / "ttq.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(summary)


def test_loops_of_different_envs_are_refused():
    other = {**LOOPS[1], "env_id": "dm_control/cartpole-swingup-v0"}
    with pytest.raises(ValueError, match="the loops act in different envs"):
        summarize_loops([LOOPS[0], other])

"""The yardstick a closed-loop score is measured on: from random actions (0) to the ceiling (1).

The ceiling is the planner imagining with the true simulator at a budget more compute cannot beat: along a curve
that doubles the candidates (``samples``) and the refits (``iterations``) together from the planner's own budget,
the first level that no later level beats on the same held-out seeds. A later level beats it when the paired 95%
confidence interval of the per-episode gain lies above :data:`MATERIAL_GAIN` of the scale (random's return to the
level's): a gain the score's third decimal would not show is no reason to spend twice the compute. :func:`budget_curve` measures that curve; the pipeline config records
the chosen budget (``control: ceiling_overrides``), and every evaluation plays its ceiling at that budget.

Beside it stands the best return known for the env from outside the project
(:data:`worldpipe.control.evaluation.BEST_KNOWN`), on the same scale, so a reader sees how far the ceiling itself
is from the state of the art.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from worldpipe.control.dynamics import true_simulator
from worldpipe.control.episodes import PlannerAgent, PolicyAgent, run_episode
from worldpipe.control.evaluation import STREAM_PREFIX, action_box, best_known, build_planner, summarize
from worldpipe.core.figures import save_figure
from worldpipe.data.episodes import episode_seeds
from worldpipe.data.policies import get_policy
from worldpipe.rollout.streams import StreamId

# The least gain, as a fraction of the scale from random to a level, that makes a later level beat it.
MATERIAL_GAIN = 0.005
# The noise stream the curve's episodes draw from: the ceiling contender's, under run seed 0.
CURVE_RUN_SEED = 0


def budget_levels(samples: int, iterations: int, levels: int) -> list[dict[str, int]]:
    """``levels`` budgets from (samples, iterations), each doubling both."""
    if levels < 2:
        raise ValueError(f"a budget curve needs at least 2 levels to see a gain stop, got {levels}")
    return [{"samples": samples << k, "iterations": iterations << k} for k in range(levels)]


def paired_gain(better: list[float], base: list[float]) -> dict[str, Any]:
    """Mean per-episode difference ``better - base`` on the same seeds and its 95% CI (Student t)."""
    summary = summarize([b - a for a, b in zip(base, better, strict=True)])
    return {"mean": summary["mean"], "ci95": summary["ci95"]}


def choose_level(returns: list[list[float]], random: float, material: float = MATERIAL_GAIN) -> int:
    """The first level no later level beats: none whose paired gain over it has a 95% CI above ``material`` of
    the scale from ``random``'s mean return to the level's."""
    for k, base in enumerate(returns):
        least = material * max(float(np.mean(base)) - random, 0.0)
        if all(paired_gain(later, base)["ci95"][0] <= least for later in returns[k + 1:]):
            return k
    return len(returns) - 1


def ceiling_returns(env_id: str, planner: dict[str, Any], box: tuple[float, float], episodes: int, max_steps: int,
                    seed: int, run_seed: int = CURVE_RUN_SEED, env_options: dict | None = None) -> list[float]:
    """Returns of the planner with the true simulator on the held-out seeds, drawing the ceiling's streams."""
    returns = []
    for i in range(episodes):
        reset_seed, rng = episode_seeds(seed, i)
        agent = PlannerAgent(build_planner(planner, *box), true_simulator(env_id, env_options),
                             StreamId(run_seed, f"{STREAM_PREFIX}/ceiling/{seed}/{i}"))
        returns.append(run_episode(env_id, max_steps, reset_seed, rng, agent, env_options=env_options).episode_return)
    return returns


def budget_curve(env_id: str, planner: dict[str, Any], episodes: int, max_steps: int, seed: int,
                 levels: int, progress=None, env_options: dict | None = None) -> dict[str, Any]:
    """The ceiling's return (mean, 95% CI) at each budget level, the paired gain of each doubling, and the level
    chosen as the ceiling with its planner overrides; random's return on the same seeds for the scale.

    ``env_options``: how the env is made beyond its id (DeepMind Control's action repeat and observation key order,
    as the closed loop's training data makes it); recorded in the curve where they are not the defaults."""

    torch.set_num_threads(1)  # as the evaluation: its bits must not depend on the machine's cores
    box = action_box(env_id)
    points, all_returns = [], []
    for budget in budget_levels(int(planner["samples"]), int(planner["iterations"]), levels):
        returns = ceiling_returns(env_id, {**planner, **budget}, box, episodes, max_steps, seed,
                                  env_options=env_options)
        point = {**budget, "compute": budget["samples"] * budget["iterations"], **summarize(returns),
                 "returns": returns}
        if all_returns:
            point["gain_over_previous"] = paired_gain(returns, all_returns[-1])
        points.append(point)
        all_returns.append(returns)
        if progress is not None:
            progress(point)
    random = [run_episode(env_id, max_steps, *episode_seeds(seed, i), PolicyAgent(get_policy(env_id, "random")),
                          env_options=env_options).episode_return for i in range(episodes)]
    chosen = choose_level(all_returns, float(np.mean(random)))
    made = {key: value for key, value in (env_options or {}).items() if value not in (None, 1)}
    return {
        "env_id": env_id, "episodes": episodes, "max_steps": max_steps, "seed": seed, "run_seed": CURVE_RUN_SEED,
        **({"env_options": env_options} if made else {}),
        "planner": planner, "levels": points, "chosen_level": chosen,
        "ceiling_overrides": [f"{key}={points[chosen][key]}" for key in ("samples", "iterations")],
        "criterion": ("the first level no later level beats: no paired 95% CI of the per-episode gain above "
                      f"{MATERIAL_GAIN:g} of the scale from random's return to the level's"),
        "material_gain": MATERIAL_GAIN,
        "random": summarize(random), "best_known": best_known(env_id),
    }


def plot_budget_curve(curve: dict[str, Any], path) -> None:
    """The ceiling's return (mean, 95% CI) against its budget, the chosen level marked, random and the best known
    return as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve["levels"]
    x = np.arange(len(points))
    means = np.array([p["mean"] for p in points])
    errors = [means - np.array([p["ci95"][0] for p in points]), np.array([p["ci95"][1] for p in points]) - means]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.errorbar(x, means, yerr=errors, fmt="o-", capsize=5, color="#c63", label="planner + true simulator")
    chosen = curve["chosen_level"]
    ax.plot([x[chosen]], [means[chosen]], "s", markersize=12, markerfacecolor="none", color="black",
            label=f"ceiling: {points[chosen]['samples']} samples x {points[chosen]['iterations']} iterations")
    known = curve.get("best_known")
    if known is not None:
        ax.axhline(known["return"], color="#36c", linestyle="--", label=f"best known {known['return']:g}")
    ax.set_xticks(x, [f"{p['samples']}x{p['iterations']}" for p in points])
    ax.set_xlabel("budget: samples x iterations per decision (each level doubles both)")
    ax.set_ylabel("episode return (mean, 95% CI)")
    ax.set_title(f"{curve['env_id']}: ceiling vs budget, {curve['episodes']} held-out seeds "
                 f"(random {curve['random']['mean']:.0f})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)

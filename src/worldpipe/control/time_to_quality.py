"""Time to quality: the collect-train loop's return against the real env steps and the wall-clock it spent, over
whole loops with different seeds (``rounds: loop_seeds``), beside the published anchors of other agents.

Each loop's summary (:func:`worldpipe.control.rounds_report.summarize_rounds`) gives, per round, the planner's mean
return on the held-out seeds, the real env steps collected so far (round 0's random episodes included) and the
loop's own wall-clock so far (its collection and training jobs; the evaluation is the measurement, not the loop).
Across loops, per round: the median return and a 95% bootstrap confidence interval of the median (resampling the
loops, a fixed generator: the same summaries give the same interval), and the median wall-clock. A loop reaches
quality at the first round whose mean return is inside (or above) the ceiling's 95% CI: the planner with the true
simulator on the same seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from worldpipe.core.figures import save_figure

# Published returns of other agents after a stated number of real env steps: reference marks, not contenders.
# ``steps`` None: a budget without a return (PETS-style configurations collect about 2,000 steps).
ANCHORS: dict[str, list[dict[str, Any]]] = {
    "Pendulum-v1": [
        {"agent": "TD3", "return": -152.0, "steps": 20_000, "source": "rl-baselines3-zoo benchmark table"},
        {"agent": "SAC", "return": -157.0, "steps": 20_000, "source": "rl-baselines3-zoo benchmark table"},
        {"agent": "PPO", "return": -172.0, "steps": 100_000, "source": "rl-baselines3-zoo benchmark table"},
        {"agent": "PETS-style budget", "return": None, "steps": 2_000,
         "source": "PETS-style configurations: about 10 episodes"},
    ],
    "dm_control/cartpole-swingup-v0": [
        {"agent": "DreamerV3 (pixels)", "return": 615.0, "steps": 100_000, "source": "DreamerV3 paper, from pixels"},
        {"agent": "DreamerV3 (pixels)", "return": 845.0, "steps": 500_000, "source": "DreamerV3 paper, from pixels"},
    ],
    "dm_control/pendulum-swingup-v0": [
        {"agent": "TD-MPC2 (state)", "return": 724.0, "steps": 100_000, "source": "TD-MPC2 published results"},
    ],
}
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def anchors(env_id: str) -> list[dict[str, Any]]:
    """The published anchors of ``env_id`` (empty where the project has none)."""
    return [dict(anchor) for anchor in ANCHORS.get(env_id, [])]


def median_ci(values: list[float]) -> dict[str, Any]:
    """Median of ``values`` and the 95% percentile-bootstrap CI of the median (one value: the value itself)."""
    data = np.asarray(values, dtype=np.float64)
    median = float(np.median(data))
    if len(data) < 2:
        return {"median": median, "ci95": [median, median], "n": len(data)}
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    medians = np.median(data[rng.integers(0, len(data), size=(BOOTSTRAP_RESAMPLES, len(data)))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"median": median, "ci95": [float(low), float(high)], "n": len(data)}


def reached_quality(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first round of one loop whose mean return is at least the ceiling's CI's lower bound, None if none."""
    bar = summary["ceiling"]["ci95"][0]
    for row in summary["rounds"]:
        if row["return_mean"] >= bar:
            return {"round": row["round"], "env_steps": row["env_steps"], "loop_wall_clock_s": row["loop_wall_clock_s"]}
    return None


def summarize_loops(summaries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Per round across loops: env steps, median return (95% CI), median loop wall-clock and its split; per loop
    its final return and when it reached quality; random, the ceiling and the anchors from the first loop."""
    if not summaries:
        raise ValueError("time to quality needs at least one loop's summary")
    first = summaries[0]
    envs = {s["env_id"] for s in summaries}
    if len(envs) > 1:
        raise ValueError(f"the loops act in different envs ({', '.join(sorted(envs))}); summarise one env at a time")
    rounds = min(len(s["rounds"]) for s in summaries)
    rows = []
    for k in range(rounds):
        at = [s["rounds"][k] for s in summaries]
        clocks = [r["loop_wall_clock_s"] for r in at if r.get("loop_wall_clock_s") is not None]
        split = {part: [r["wall_clock_s"][part] for r in at if (r.get("wall_clock_s") or {}).get(part) is not None]
                 for part in ("collection", "training", "evaluation")}
        rows.append({
            "round": k, "env_steps": [r["env_steps"] for r in at],
            "env_steps_median": float(np.median([r["env_steps"] for r in at])),
            "returns": [r["return_mean"] for r in at], "return": median_ci([r["return_mean"] for r in at]),
            "loop_wall_clock_s": clocks, "loop_wall_clock_median_s": float(np.median(clocks)) if clocks else None,
            "wall_clock_split_median_s": {part: float(np.median(v)) if v else None for part, v in split.items()},
        })
    loops = [{"mlflow_parent_run_id": s.get("mlflow_parent_run_id"), "final_return": s["rounds"][-1]["return_mean"],
              "final_env_steps": s["rounds"][-1]["env_steps"], "reached_quality": reached_quality(s)}
             for s in summaries]
    reached = [loop["reached_quality"]["env_steps"] for loop in loops if loop["reached_quality"]]
    return {
        "env_id": first["env_id"], "experiment": first.get("experiment"), "seeds": first["seeds"],
        "loops": loops, "rounds": rows, "random": first["random"], "ceiling": first["ceiling"],
        "behaviour_policy": first.get("behaviour_policy"), "best_known": first.get("best_known"),
        "anchors": anchors(first["env_id"]),
        "quality": {"criterion": "mean return at least the lower bound of the ceiling's 95% CI",
                    "loops_reached": len(reached), "loops": len(loops),
                    "env_steps_median": float(np.median(reached)) if reached else None},
        "ci": f"95% percentile bootstrap of the median over loops ({BOOTSTRAP_RESAMPLES} resamples, seed "
              f"{BOOTSTRAP_SEED})",
    }


def table(summary: Mapping[str, Any]) -> str:
    """Per round across loops, as Markdown: env steps, median return [95% CI], median wall-clock and its split."""
    lines = [f"| round | env steps | return, median of {len(summary['loops'])} loops [95% CI] | loop wall-clock s "
             "(median) | collect / train / evaluate s (median) |", "|---|---|---|---|---|"]
    for row in summary["rounds"]:
        low, high = row["return"]["ci95"]
        clock = "-" if row["loop_wall_clock_median_s"] is None else f"{row['loop_wall_clock_median_s']:.0f}"
        split = " / ".join("-" if v is None else f"{v:.0f}" for v in row["wall_clock_split_median_s"].values())
        lines.append(f"| {row['round']} | {row['env_steps_median']:.0f} | {row['return']['median']:.1f} "
                     f"[{low:.1f}, {high:.1f}] | {clock} | {split} |")
    for name in ("random", "ceiling"):
        low, high = summary[name]["ci95"]
        lines.append(f"| {name} | | {summary[name]['mean']:.1f} [{low:.1f}, {high:.1f}] (mean, 95% CI) | | |")
    return "\n".join(lines)


def plot_time_to_quality(summary: Mapping[str, Any], path) -> None:
    """Return against env steps (left) and against the loop's wall-clock (right): each loop thin, the median with
    its CI bold; random and the ceiling as bands, the anchors as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rounds"]
    fig, (by_steps, by_clock) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = np.array([r["return"]["median"] for r in rows])
    errors = np.array([[m - r["return"]["ci95"][0], r["return"]["ci95"][1] - m] for m, r in zip(medians, rows,
                                                                                              strict=True)]).T
    steps = np.array([r["env_steps_median"] for r in rows])
    for i in range(len(summary["loops"])):
        by_steps.plot([r["env_steps"][i] for r in rows], [r["returns"][i] for r in rows], color="#36c", alpha=0.25,
                      linewidth=1)
    by_steps.errorbar(steps, medians, yerr=errors, marker="o", capsize=4, color="#36c", linewidth=2,
                      label=f"planner + round's model (median of {len(summary['loops'])} loops, 95% CI)")
    clocks = [r["loop_wall_clock_median_s"] for r in rows]
    if all(c is not None for c in clocks):
        by_clock.errorbar(np.array(clocks) / 60, medians, yerr=errors, marker="o", capsize=4, color="#36c",
                          linewidth=2, label="median over loops (95% CI)")
    for ax in (by_steps, by_clock):
        for name, color, label in (("random", "#999", "random"), ("ceiling", "#c63", "planner + true simulator")):
            low, high = summary[name]["ci95"]
            ax.axhline(summary[name]["mean"], color=color, linestyle="--", label=label)
            ax.axhspan(low, high, color=color, alpha=0.12)
        ax.set_ylabel(f"episode return, {summary['seeds']} held-out seeds")
    for anchor in summary["anchors"]:
        if anchor["return"] is None:
            by_steps.axvline(anchor["steps"], color="#6a6", linestyle=":", label=f"{anchor['agent']}: "
                             f"{anchor['steps']:,} steps")
        else:
            by_steps.plot([anchor["steps"]], [anchor["return"]], marker="*", markersize=12, linestyle="none",
                          label=f"{anchor['agent']}: {anchor['return']:g} at {anchor['steps']:,} steps")
    by_steps.set_xscale("log")
    by_steps.set_xlabel("real environment steps (round 0's random episodes included; log scale)")
    by_clock.set_xlabel("loop wall-clock, collection + training (minutes, median over loops)")
    by_steps.set_title(f"{summary['experiment']}: {summary['env_id']} from scratch", fontsize=10)
    by_steps.legend(fontsize=7, loc="lower right")
    by_clock.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)

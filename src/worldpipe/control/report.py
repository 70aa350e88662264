"""Figures of a closed-loop evaluation: returns with their confidence intervals, and the control loop's split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from worldpipe.core.atomic import write_atomic
from worldpipe.core.figures import save_figure
from worldpipe.evaluate.pictures import side_by_side_gif, to_frames

LABELS = {"random": "random", "behaviour": "behaviour policy", "planner": "planner + model",
          "ceiling": "planner + true simulator", "http_probe": "planner + served model (HTTP)"}
# The contenders whose returns are compared (the HTTP probe plays a few episodes, for its timing only).
COMPARED = ("random", "behaviour", "planner", "ceiling")


def plot_returns(result: dict[str, Any], path: str | Path) -> None:
    """Mean episode return per contender with its 95% CI (error bars), held-out seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in COMPARED if name in result["contenders"]]
    means = np.array([result["contenders"][n]["mean"] for n in names])
    lows = means - np.array([result["contenders"][n]["ci95"][0] for n in names])
    highs = np.array([result["contenders"][n]["ci95"][1] for n in names]) - means
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(names)), means, yerr=[lows, highs], capsize=6, color=[COLORS[n] for n in names])
    ax.set_xticks(range(len(names)), [LABELS.get(n, n) for n in names], rotation=15)
    known = (result.get("yardstick") or {}).get("best_known")
    if known is not None:
        ax.axhline(known["return"], color="#36c", linestyle="--", linewidth=1, label=f"best known {known['return']:g}")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("episode return (mean, 95% CI)")
    settings = result["settings"]
    score = result.get("score")
    ax.set_title(f"{result.get('experiment')}: {settings['env_id']}, {settings['episodes']} held-out seeds"
                 + ("" if score is None else f", score {score:.3f} (0 random, 1 ceiling)"), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


COLORS = {"random": "#999", "behaviour": "#6a6", "planner": "#36c", "ceiling": "#c63"}


def plot_control_overview(records: dict[str, dict[str, Any]], path: str | Path) -> dict[str, Any]:
    """Every run's closed-loop return (mean, 95% CI) beside the floor, the behaviour policy and the ceiling
    measured on the same seeds: one row per run, labelled by its experiment and run hash (``records``: label ->
    control.json). Returns what it drew: label -> contender -> (mean, low, high), and each run's score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(8, 1.9 + 0.9 * len(records)), layout="constrained")
    offsets = {name: (i - (len(COMPARED) - 1) / 2) * 0.18 for i, name in enumerate(COMPARED)}
    for row, (label, record) in enumerate(records.items()):
        drawn[label] = {"score": record.get("score"), "contenders": {}}
        for name in COMPARED:
            contender = record["contenders"].get(name)
            if contender is None:
                continue
            mean, (low, high) = contender["mean"], contender["ci95"]
            drawn[label]["contenders"][name] = (mean, low, high)
            ax.errorbar(mean, row + offsets[name], xerr=[[mean - low], [high - mean]], fmt="o", capsize=4,
                        color=COLORS[name], label=LABELS[name] if row == 0 else None)
        score = record.get("score")
        if score is not None:
            ax.annotate(f"score {score:.2f}", (1.0, row), xycoords=("axes fraction", "data"), xytext=(6, 0),
                        textcoords="offset points", va="center", fontsize=9)
    first_record = next(iter(records.values()))
    best = first_record.get("yardstick", {}).get("best_known")
    if best is not None:  # the env's best known return (a published table), on the same axis
        ax.axvline(best["return"], color="black", linestyle=":", linewidth=1,
                   label=f"best known ({best['return']:g})")
        drawn["best_known_return"] = best["return"]
    ax.set_yticks(range(len(records)), list(records))
    ax.invert_yaxis()
    settings = first_record["settings"]
    ax.set_xlabel(f"episode return on {settings['episodes']} held-out seeds (mean, 95% CI)")
    ax.set_title(f"Closed loop in {settings['env_id']}: the planner with each model, beside its yardsticks")
    fig.legend(loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    save_figure(fig, path, dpi=100, bbox_inches="tight")
    return drawn


def plot_control_loop(result: dict[str, Any], path: str | Path) -> None:
    """p50 and p99 of each part of one real step (planner + model, in-process and over HTTP where probed, planner +
    true simulator) against the env's control period."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loops = {name: result["contenders"][name]["control_loop"] for name in ("planner", "ceiling")}
    if "http_probe" in result:
        loops = {"planner": loops["planner"], "http_probe": result["http_probe"]["control_loop"],
                 "ceiling": loops["ceiling"]}
    names = list(loops)
    parts = list(loops["planner"]["parts"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        loop = loops[name]
        x = np.arange(len(parts))
        ax.bar(x - 0.2, [loop["parts"][p]["p50_ms"] for p in parts], 0.4, label="p50")
        ax.bar(x + 0.2, [loop["parts"][p]["p99_ms"] for p in parts], 0.4, label="p99")
        if loop["period_ms"] is not None:
            ax.axhline(loop["period_ms"], color="red", linestyle="--", label=f"control period {loop['period_ms']:g} ms")
        ax.set_xticks(x, parts, rotation=30)
        ax.set_title(f"{LABELS[name]}: decision p99 {loop['decision_p99_ms']:.1f} ms")
        ax.set_ylabel("ms per real step")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def write_episode_gif(result_pictured: tuple[list[np.ndarray], list[np.ndarray]] | None, size: int | None,
                      path: str | Path) -> bool:
    """A pixel model's first held-out episode as an animated GIF: each true frame beside the frame the model
    imagined for it one step earlier, while planning. False (nothing written) for a state model."""
    if result_pictured is None or size is None:
        return False
    frames, imagined = result_pictured
    true = to_frames(np.stack(frames[1:len(imagined)]), size)
    predicted = to_frames(np.stack(imagined[:len(frames) - 1]), size)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path), side_by_side_gif(true, predicted))
    return True

"""How the collect-train loop went, round by round: the planner's return with each round's model (mean, 95% CI) and
its held-out prediction error, beside the scripted policy and random on the same held-out seeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from worldpipe.core.figures import save_figure
from worldpipe.data.manifest import load_manifest


def summarize_rounds(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds table from each round's records: ``entries`` name, per round, its run directory, open-loop metrics
    (``eval/.../metrics.json``), closed-loop record (``control/.../control.json``) and dataset manifest."""
    rows, first = [], None
    for entry in sorted(entries, key=lambda e: e["round"]):
        control = json.loads(Path(entry["control"]).read_text())
        metrics = json.loads(Path(entry["metrics"]).read_text())
        manifest = load_manifest(entry["manifest"])
        first = first or control
        planner = control["contenders"]["planner"]
        rows.append({
            "round": entry["round"], "run_dir": entry["run_dir"], "mlflow_run_id": control.get("mlflow_run_id"),
            "checkpoint_digest": control["checkpoint_digest"], "dataset_hash": manifest["dataset_hash"],
            "episodes": manifest["episodes"], "lineage": manifest.get("lineage"),
            "return_mean": planner["mean"], "return_ci95": planner["ci95"], "score": control["score"],
            "heldout_one_step_ratio": metrics["one_step_ratio"], "heldout_ratio": metrics["ratio"][-1],
            "heldout_model_mse": metrics["model_mse"][-1], "horizon": metrics["horizon"],
        })
    fixed = {name: {"mean": first["contenders"][name]["mean"], "ci95": first["contenders"][name]["ci95"]}
             for name in ("random", "behaviour", "ceiling")}
    return {"rounds": rows, "seeds": first["settings"]["episodes"], "env_id": first["settings"]["env_id"],
            "experiment": first.get("experiment"), **fixed}


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (the closing notes and `worldpipe rounds summarize` print it)."""
    lines = ["| round | episodes | planner return (mean, 95% CI) | score | held-out error ratio (h=H) |",
             "|---|---|---|---|---|"]
    for row in summary["rounds"]:
        low, high = row["return_ci95"]
        lines.append(f"| {row['round']} | {row['episodes']} | {row['return_mean']:.1f} [{low:.1f}, {high:.1f}] | "
                     f"{row['score']:.2f} | {row['heldout_ratio']:.3f} (h={row['horizon']}) |")
    for name in ("behaviour", "random", "ceiling"):
        low, high = summary[name]["ci95"]
        lines.append(f"| {name} | | {summary[name]['mean']:.1f} [{low:.1f}, {high:.1f}] | | |")
    return "\n".join(lines)


def plot_rounds(summary: dict[str, Any], path: str | Path) -> None:
    """Return against round (95% CI) beside the scripted policy's and random's; held-out error against round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rounds"]
    x = np.array([r["round"] for r in rows])
    means = np.array([r["return_mean"] for r in rows])
    errors = np.array([[m - r["return_ci95"][0], r["return_ci95"][1] - m] for m, r in zip(means, rows, strict=True)]).T
    fig, (ax, err) = plt.subplots(1, 2, figsize=(10, 4))
    ax.errorbar(x, means, yerr=errors, marker="o", capsize=5, color="#36c", label="planner + round's model")
    for name, color, label in (("behaviour", "#6a6", "scripted policy (round 0's data)"), ("random", "#999", "random"),
                               ("ceiling", "#c63", "planner + true simulator")):
        low, high = summary[name]["ci95"]
        ax.axhline(summary[name]["mean"], color=color, linestyle="--", label=label)
        ax.axhspan(low, high, color=color, alpha=0.12)
    ax.set_xticks(x)
    ax.set_xlabel("collection round (model trained on rounds 0..k)")
    ax.set_ylabel(f"episode return, {summary['seeds']} held-out seeds (mean, 95% CI)")
    ax.set_title(f"{summary['experiment']}: {summary['env_id']}")
    ax.legend(fontsize=8, loc="lower right")
    err.plot(x, [r["heldout_ratio"] for r in rows], marker="o", label=f"h={rows[0]['horizon']} error / repeat-last")
    err.plot(x, [r["heldout_one_step_ratio"] for r in rows], marker="s", label="one-step error / repeat-last")
    err.set_xticks(x)
    err.set_yscale("log")
    err.set_xlabel("collection round")
    err.set_ylabel("held-out prediction error ratio (lower is better)")
    err.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)

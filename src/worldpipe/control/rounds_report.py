"""How the collect-train loop went, round by round: the planner's return with each round's model (mean, 95% CI) and
its held-out prediction error, beside the scripted policy and random on the same held-out seeds; the real env steps
collected so far, the returns of the episodes each round added to the data (what its exploration found, in the
real env), and the wall-clock each round took by part (collection, training, evaluation: the Snakemake benchmarks of
its jobs, summed).

A loop from scratch has random actions as its round 0's policy: its "behaviour" contender is random itself, so the
summary says so (``behaviour_is_random``) and the table and figure show random once. Its scores are on the ceiling's
yardstick (random 0, the planner with the true simulator 1), defined wherever those two differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from worldpipe.config import paths
from worldpipe.core.figures import save_figure
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore

PARTS = ("collection", "training", "evaluation")


def benchmark_seconds(files: list[str]) -> float | None:
    """The summed wall-clock seconds (the ``s`` column) of Snakemake benchmark files; None where one is missing (a
    job done before benchmarks were kept, or a summary built outside the pipeline)."""
    total = 0.0
    for file in files:
        path = Path(file)
        if not path.is_file():
            return None
        lines = path.read_text().splitlines()
        header, values = lines[0].split("\t"), lines[-1].split("\t")
        total += float(values[header.index("s")])
    return total


def wall_clock(benchmarks: dict[str, list[str]] | None) -> dict[str, float | None]:
    """Seconds per part of a round (collection, training, evaluation) from its jobs' benchmarks, and their sum."""
    parts = {part: benchmark_seconds((benchmarks or {}).get(part, [])) if benchmarks else None for part in PARTS}
    known = [v for v in parts.values() if v is not None]
    return {**parts, "total": sum(known) if len(known) == len(PARTS) else None}


def summarize_rounds(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds table from each round's records: ``entries`` name, per round, its run directory, open-loop metrics
    (``eval/.../metrics.json``), closed-loop record (``control/.../control.json``) and dataset manifest."""
    rows, first, env_steps, previous_steps = [], None, 0, 0
    for entry in sorted(entries, key=lambda e: e["round"]):
        control = json.loads(Path(entry["control"]).read_text())
        metrics = json.loads(Path(entry["metrics"]).read_text())
        manifest = load_manifest(entry["manifest"])
        first = first or control
        planner = control["contenders"]["planner"]
        copied = ((manifest.get("lineage") or {}).get("episodes") or {}).get("copied", 0)
        # Stored steps are decisions; each is action_repeat steps of the env (DeepMind Control's anchors count those).
        repeat = int(manifest["spec"].get("action_repeat", 1))
        steps = manifest["steps"] * repeat
        collected = steps - (previous_steps if copied else 0)  # union: the parent's steps come first
        env_steps, previous_steps = env_steps + collected, steps
        added = _added_returns(entry["manifest"], manifest, copied)
        rows.append({
            "run_hash": Path(entry["run_dir"]).name, "control_hash": Path(entry["control"]).parent.name,
            "env_steps": env_steps, "collected_steps": collected, "wall_clock_s": wall_clock(entry.get("benchmarks")),
            "round": entry["round"], "run_dir": entry["run_dir"], "mlflow_run_id": control.get("mlflow_run_id"),
            "checkpoint_digest": control["checkpoint_digest"], "dataset_hash": manifest["dataset_hash"],
            "episodes": manifest["episodes"], "lineage": manifest.get("lineage"), "collected_returns": added,
            "return_mean": planner["mean"], "return_ci95": planner["ci95"], "score": control["score"],
            "heldout_one_step_ratio": metrics["one_step_ratio"], "heldout_ratio": metrics["ratio"][-1],
            "heldout_model_mse": metrics["model_mse"][-1], "horizon": metrics["horizon"],
        })
    fixed = {name: {"mean": first["contenders"][name]["mean"], "ci95": first["contenders"][name]["ci95"]}
             for name in ("random", "behaviour", "ceiling")}
    elapsed = 0.0
    for row in rows:  # the loop's own time so far: collecting and training (evaluating is the measurement)
        clock = row["wall_clock_s"]
        spent = None if clock["collection"] is None or clock["training"] is None else clock["collection"] + clock["training"]
        elapsed = None if elapsed is None or spent is None else elapsed + spent
        row["loop_wall_clock_s"] = elapsed
    policy = first["settings"]["behaviour_policy"]
    return {"rounds": rows, "seeds": first["settings"]["episodes"], "env_id": first["settings"]["env_id"],
            "experiment": first.get("experiment"), "behaviour_policy": policy,
            "behaviour_is_random": policy == "random", "best_known": first.get("yardstick", {}).get("best_known"),
            **fixed}


def _added_returns(manifest_path: str, manifest: dict[str, Any], copied: int) -> list[float]:
    """Returns (summed rewards) of a round's dataset's episodes after the ``copied`` ones: those it collected."""
    store = TrajectoryStore.open(str(Path(manifest_path).with_name(paths.STORE_NAME)), manifest)
    arrays = store.read_episodes(copied, store.num_episodes)
    return [round(float(arrays["reward"][i, :n].sum(dtype=np.float64)), 6) for i, n in enumerate(arrays["length"])]


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (the closing notes and `worldpipe rounds summarize` print it)."""
    lines = ["| round | episodes | env steps | collected return (mean) | planner return (mean, 95% CI) | score "
             "| held-out error ratio (h=H) | wall-clock s (collect / train / evaluate) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in summary["rounds"]:
        low, high = row["return_ci95"]
        score = "n/a" if row["score"] is None else f"{row['score']:.2f}"
        clock = row.get("wall_clock_s") or {}
        times = " / ".join("-" if clock.get(p) is None else f"{clock[p]:.0f}" for p in PARTS)
        added = row.get("collected_returns")
        found = f"{np.mean(added):.1f}" if added else ""
        lines.append(f"| {row['round']} | {row['episodes']} | {row.get('env_steps', '')} | {found} | {row['return_mean']:.1f} "
                     f"[{low:.1f}, {high:.1f}] | {score} | {row['heldout_ratio']:.3f} (h={row['horizon']}) | {times} |")
    shown = ("random", "ceiling") if summary.get("behaviour_is_random") else ("behaviour", "random", "ceiling")
    for name in shown:
        low, high = summary[name]["ci95"]
        lines.append(f"| {name} | | | | {summary[name]['mean']:.1f} [{low:.1f}, {high:.1f}] | | | |")
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
    marks = [("behaviour", "#6a6", "scripted policy (round 0's data)"), ("random", "#999", "random"),
             ("ceiling", "#c63", "planner + true simulator")]
    if summary.get("behaviour_is_random"):
        marks = [("random", "#999", "random (round 0's data)"), marks[2]]
    for name, color, label in marks:
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

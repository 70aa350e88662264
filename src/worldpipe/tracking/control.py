"""Closed-loop evaluations in MLflow: returns per episode, their summaries, on the run and on its logged model.

A control evaluation goes to a nested child run of the training run (``<run>-control-<planner>``): its "Step" axis
is the held-out episode, so ``control/<contender>/return`` at step i is episode i's return (the training run keeps
training steps on its axis). The training run gets the summaries at the evaluated checkpoint's step
(``control/<contender>/return_mean``, ``.../return_ci95_low``, ``.../return_ci95_high``, ``control/score``,
``control/ceiling_score``, ``control/behaviour_score``, ``control/decision_p99_ms`` and, where the loop was probed
over HTTP, ``control/http_probe/decision_p99_ms``), and so does the logged model of the checkpoint, where one
exists, together with the planner's per-episode returns. The HTTP probe is timing, never a return or a score. Idempotent per evaluation key (checkpoint digest and
settings): the same evaluation logged twice adds nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from worldpipe.config.identity import flatten
from worldpipe.tracking.connection import client_for
from worldpipe.tracking.evaluation import child_run, log_once

PREFIX = "control/"
KEY_TAG = "worldpipe.control.key"
COMPLETE_TAG = "worldpipe.control.complete"
DIGEST_TAG = "worldpipe.control.checkpoint_digest"
ARTIFACT_DIR = "control"
# Measured by the clock (they differ run to run); every other control metric is a function of the records.
CLOCK_METRICS = (f"{PREFIX}decision_p99_ms", f"{PREFIX}http_probe/decision_p99_ms")


def control_key(result: Mapping[str, Any]) -> str:
    """Identity of a control evaluation: the checkpoint digest and every setting."""
    text = json.dumps({"digest": result["checkpoint_digest"], "settings": result["settings"]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def summary_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The summaries the training run and the logged model carry (name -> value)."""
    values: dict[str, float] = {}
    for name, c in result["contenders"].items():
        values[f"{PREFIX}{name}/return_mean"] = c["mean"]
        values[f"{PREFIX}{name}/return_ci95_low"], values[f"{PREFIX}{name}/return_ci95_high"] = c["ci95"]
    for key in ("score", "ceiling_score", "behaviour_score"):
        if result.get(key) is not None:
            values[f"{PREFIX}{key}"] = result[key]
    decision, probe = CLOCK_METRICS
    values[decision] = result["contenders"]["planner"]["control_loop"]["decision_p99_ms"]
    if "http_probe" in result:
        values[probe] = result["http_probe"]["control_loop"]["decision_p99_ms"]
    return values


def control_summary_keys(keys: set[str]) -> list[str]:
    """The closed-loop summaries among a run's metric names, in reading order: the scores, then the planner's
    return, then every other contender's and the loop's clock (per-episode histories are the child run's)."""
    summaries = [k for k in keys if k.startswith(PREFIX) and not k.endswith("/return")]

    def rank(key: str) -> tuple[int, str]:
        name = key[len(PREFIX):]
        scalar = "/" not in name
        first = 0 if name == "score" else 1 if scalar and name.endswith("score") else 2 if name.startswith(
            "planner/") else 3
        return first, name

    return sorted(summaries, key=rank)


def log_control(uri: str, run_id: str, result: Mapping[str, Any], files: Sequence[str],
                model_id: str | None) -> str:
    """Log a control evaluation of run ``run_id`` (and onto logged model ``model_id``); the child run's id."""
    from mlflow.entities import Metric, Param

    client = client_for(uri)
    key = control_key(result)
    planner = str(result["settings"]["planner"].get("_target_", "")).rsplit(".", 1)[-1]
    # The digest tag names the key, kept short for the UI's tag column.
    child = child_run(client, client.get_run(run_id), f"control-{planner}", {KEY_TAG: key, DIGEST_TAG: key[:16]})

    def log(child_id: str) -> None:
        now, step = int(time.time() * 1000), int(result["checkpoint_step"])
        per_episode = [Metric(f"{PREFIX}{name}/return", float(value), now, i)
                       for name, c in result["contenders"].items() for i, value in enumerate(c["returns"])]
        summaries = [Metric(k, float(v), now, step) for k, v in summary_metrics(result).items()]
        # An empty mapping (a planner's defaults) has no keys to record.
        params = [Param(f"control.{k}", str(v)) for k, v in flatten(result["settings"]).items() if v != {}]
        client.log_batch(child_id, metrics=per_episode + summaries, params=params)
        for path in files:
            client.log_artifact(child_id, path, ARTIFACT_DIR)
        client.log_batch(run_id, metrics=summaries)
        if model_id is not None:
            planner_returns = [m for m in per_episode if m.key == f"{PREFIX}planner/return"]
            client.log_batch(child_id, metrics=[Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id,
                                                       run_id=child_id) for m in planner_returns + summaries])

    log_once(client, child, COMPLETE_TAG, key, True, log)
    return child.info.run_id

"""Reading runs back from MLflow: recorded config and identity, metric histories, comparisons."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from worldpipe.config.identity import flatten
from worldpipe.tracking.delivery import CHANGED_TAG_PREFIX
from worldpipe.tracking.evaluation import CONTROL_PREFIX
from worldpipe.tracking.evaluation import METRIC_PREFIX as EVAL_PREFIX
from worldpipe.tracking.records import OVERFLOW_ARTIFACT_DIR, TIMING_METRICS, split_params
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX

# Metrics that are not part of a training run's computation: the machine's, and evaluations (open-loop and
# closed-loop) logged afterwards.
NOT_TRAINING_PREFIXES = (SYSTEM_PREFIX, EVAL_PREFIX, CONTROL_PREFIX)


class RecordError(RuntimeError):
    """The MLflow records of a run are missing or inconsistent."""

def read_artifact(client, run_id: str, path: str) -> bytes:
    """Bytes of one artifact file of a run; RecordError if it is not there."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(prefix="worldpipe-artifact-") as tmp:
        try:
            local = client.download_artifacts(run_id, path, tmp)
        except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for a missing file
            raise RecordError(f"run {run_id} has no artifact {path!r} ({type(err).__name__}: {err})") from err
        return Path(local).read_bytes()


def histories(client, run_id: str, keys: Iterable[str] | None = None) -> dict[str, list[tuple[int, int, float]]]:
    """{metric: [(step, timestamp, value), ...] sorted by step then timestamp}."""
    if keys is None:
        keys = client.get_run(run_id).data.metrics.keys()
    return {key: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))
            for key in sorted(keys)}


def duplicate_steps(history: Mapping[str, list[tuple[int, int, float]]]) -> dict[str, list[int]]:
    """Steps recorded more than once, per metric (empty when the history is clean)."""
    counts = {key: Counter(step for step, *_ in points) for key, points in history.items()}
    return {key: sorted(s for s, n in c.items() if n > 1) for key, c in counts.items()
            if max(c.values(), default=0) > 1}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _aligned(a: Mapping[str, list[tuple[int, int, float]]], b: Mapping[str, list[tuple[int, int, float]]],
             ignore: Iterable[str]) -> dict[tuple[int, str], tuple[Any, Any]]:
    """{(step, metric): (value in a, value in b)} over the training metrics either history holds (None: absent)."""
    out = {}
    for key in (set(a) | set(b)) - set(ignore):
        if not key.startswith(NOT_TRAINING_PREFIXES):
            va, vb = ({s: v for s, _, v in history.get(key, [])} for history in (a, b))
            out.update({(step, key): (va.get(step), vb.get(step)) for step in set(va) | set(vb)})
    return out


def first_difference(a: Mapping[str, list[tuple[int, int, float]]], b: Mapping[str, list[tuple[int, int, float]]],
                     ignore: Iterable[str] = TIMING_METRICS) -> tuple[int, str, Any, Any] | None:
    """First (step, metric, value_a, value_b) where two histories differ bitwise; None if identical.

    Values are compared per step (timestamps ignored); a step or metric present on one side only is a
    difference (its missing side shown as None); system and evaluation metrics (open- and closed-loop) are not
    compared. Steps are visited in order, metrics by name within a step.
    """
    for (step, key), (x, y) in sorted(_aligned(a, b, ignore).items()):
        if x is None or y is None or not _same(x, y):
            return step, key, x, y
    return None


def largest_relative_difference(a: Mapping[str, list[tuple[int, int, float]]],
                                b: Mapping[str, list[tuple[int, int, float]]],
                                ignore: Iterable[str] = TIMING_METRICS) -> tuple[float, int | None, str | None]:
    """(largest |x - y| / max(|x|, |y|), its step, its metric) over the values both histories hold at the same
    step (the metrics :func:`first_difference` compares); inf where only one side holds a value or one is NaN."""
    worst: tuple[float, int | None, str | None] = (0.0, None, None)
    for (step, key), (x, y) in sorted(_aligned(a, b, ignore).items(), key=lambda item: item[0][::-1]):
        if x is None or y is None or math.isnan(x) != math.isnan(y):
            return math.inf, step, key
        if not _same(x, y) and abs(x - y) / max(abs(x), abs(y)) > worst[0]:
            worst = (abs(x - y) / max(abs(x), abs(y)), step, key)
    return worst


@dataclass
class RecordedRun:
    """Everything `rerun`/`resume` rebuild a run from, read from MLflow alone."""
    run_id: str
    run: Any
    config: dict
    identity: dict
    manifest: dict | None

    @property
    def tags(self) -> dict[str, str]:
        return self.run.data.tags

    @property
    def world_size(self) -> int:
        return int(self.identity.get("world_size") or self.tags.get("worldpipe.world_size") or 1)


def load_recorded_run(client, run_id: str) -> RecordedRun:
    """Config (type-exact, from config.yaml, checked against the params), identity and dataset manifest."""
    try:
        run = client.get_run(run_id)
    except Exception as err:  # noqa: BLE001
        raise RecordError(f"no MLflow run {run_id} at {client.tracking_uri}: {err}") from err
    config = yaml.safe_load(read_artifact(client, run_id, "config.yaml"))
    identity = json.loads(read_artifact(client, run_id, "identity.json"))
    try:
        manifest = json.loads(read_artifact(client, run_id, "dataset/manifest.json"))
    except RecordError:
        manifest = None
    check_params(client, run, config)
    return RecordedRun(run_id, run, config, identity, manifest)


def check_params(client, run, config: Mapping) -> None:
    """Every flattened config key is a param with the same text (overflowed ones: the artifact's content).

    A key whose value changed on a resume keeps its first value as the param (MLflow never changes one) and
    carries the latest in the tag `worldpipe.changed.<key>`; config.yaml is the latest segment's config.
    """
    params, tags = run.data.params, run.data.tags
    fitting, overflow = split_params(flatten(config))
    problems = []
    for key, text in fitting.items():
        if key in overflow:
            if params.get(key) != text:
                problems.append(f"{key}: param {params.get(key)!r} is not the overflow pointer {text!r}")
            elif read_artifact(client, run.info.run_id, f"{OVERFLOW_ARTIFACT_DIR}/{key}.txt").decode() != overflow[key]:
                problems.append(f"{key}: {OVERFLOW_ARTIFACT_DIR}/{key}.txt differs from config.yaml")
            continue
        recorded = tags.get(f"{CHANGED_TAG_PREFIX}{key}", params.get(key))
        if recorded != text:
            problems.append(f"{key}: param {recorded!r} != config.yaml {text!r}")
    if problems:
        raise RecordError(f"params of run {run.info.run_id} disagree with its config.yaml:\n  " + "\n  ".join(problems))

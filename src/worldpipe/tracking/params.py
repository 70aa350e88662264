"""Lossless MLflow params: every flattened config key, values too long for MLflow stored as artifacts."""

from __future__ import annotations

import json
from typing import Any

# MLflow's server-side limit on a param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
MAX_PARAM_VALUE_LENGTH = 6000
OVERFLOW_ARTIFACT_DIR = "params_overflow"


def param_text(value: Any) -> str:
    """The string MLflow stores for a value (JSON for lists and null, so it reads back unambiguously)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def split_params(flat: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Split params into those that fit and overflow values; overflow params point at their artifact."""
    fitting: dict[str, str] = {}
    overflow: dict[str, str] = {}
    for key, value in flat.items():
        text = param_text(value)
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            overflow[key] = text
            fitting[key] = f"<artifact:{OVERFLOW_ARTIFACT_DIR}/{key}.txt>"
        else:
            fitting[key] = text
    return fitting, overflow

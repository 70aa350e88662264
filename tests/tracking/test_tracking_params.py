"""Lossless params: every key, values beyond MLflow's limit pointed to an artifact."""

from worldpipe.config.identity import flatten
from worldpipe.tracking.records import MAX_PARAM_VALUE_LENGTH, OVERFLOW_ARTIFACT_DIR, param_text, split_params


def test_every_key_is_kept_and_long_values_overflow_whole():
    long = "x" * (MAX_PARAM_VALUE_LENGTH + 1)
    flat = flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": long, "f": "ok", "g": {}})
    fitting, overflow = split_params(flat)
    assert set(fitting) == set(flat) == {"a.b", "a.c", "d", "e", "f", "g"}
    assert fitting["a.b"] == "1" and fitting["a.c"] == "[1, 2]" and fitting["d"] == "null"
    assert overflow == {"e": long}
    assert fitting["e"] == f"<artifact:{OVERFLOW_ARTIFACT_DIR}/e.txt>"


def test_value_exactly_at_the_limit_stays_a_param():
    text = "y" * MAX_PARAM_VALUE_LENGTH
    fitting, overflow = split_params({"k": text})
    assert fitting == {"k": text} and not overflow
    assert param_text(True) == "true" and param_text(0.1) == "0.1"

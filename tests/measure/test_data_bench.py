"""The loader benchmark's measured training demand (its end-to-end run and JSON: tests/measure/test_bench_cli.py)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loader.py"


def test_training_demand_is_measured_when_not_given():
    # The CLI test passes --demand (a fixed yardstick); without it the benchmark times a tiny GRU step itself.
    spec = importlib.util.spec_from_file_location("bench_loader", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.training_demand_windows_per_s(batch=2, window=4, steps=2) > 0

"""The all_reduce ring-model fit of benchmarks/bench_comm.py: exact on model timings, honest on noisy ones."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_comm.py"


@pytest.fixture(scope="module")
def bench_comm():
    spec = importlib.util.spec_from_file_location("bench_comm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(seconds_of, sizes=(1024, 4096, 16384, 65536, 262144, 1048576)):
    return [{"bytes": size, "seconds": seconds_of(size)} for size in sizes]


def test_fit_recovers_alpha_and_bandwidth_from_model_timings(bench_comm):
    n, alpha, beta = 4, 50e-6, 1 / 2e9
    rows = _rows(lambda g: 2 * (n - 1) * alpha + 2 * (n - 1) / n * beta * g)
    fit = bench_comm.fit_ring_model(rows, n)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["bandwidth_GBps"] == pytest.approx(2.0, rel=1e-6)
    assert fit["max_abs_fit_error"] < 1e-6


def test_timings_that_fall_with_size_give_no_negative_bandwidth(bench_comm):
    # One noisy repeat: the largest message happened to be fastest. Least squares would fit beta < 0.
    rows = _rows(lambda g: 1e-3 - g * 5e-10)
    fit = bench_comm.fit_ring_model(rows, 4)
    assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
    assert fit["bandwidth_GBps"] is None
    assert "not resolved" in bench_comm.describe_fit(fit)

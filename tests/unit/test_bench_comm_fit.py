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


def test_two_regimes_fit_a_latency_bound_and_a_bandwidth_bound_line(bench_comm):
    # Small messages on one alpha-beta line, large ones on another (cache-bound vs memory-bound copies): one
    # line over all sizes misses the large ones badly; the two-regime fit recovers both lines and the split.
    n = 2
    sizes = [1024 * 4**k for k in range(9)]  # 1 KB .. 64 MB, as the benchmark measures

    def seconds(g):
        alpha, beta = (30e-6, 1 / 8e9) if g < (1 << 20) else (400e-6, 1 / 1.5e9)
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * beta * g

    rows = _rows(seconds, sizes)
    one_line = bench_comm.fit_ring_model(rows, n)
    fit = bench_comm.fit_two_regimes(rows, n)
    assert one_line["max_abs_fit_error"] > 0.3  # what the single line did
    assert fit["regimes"] == 2 and fit["split_bytes"] == 1 << 20
    assert fit["small"]["alpha_s"] == pytest.approx(30e-6, rel=1e-6)
    assert fit["large"]["bandwidth_GBps"] == pytest.approx(1.5, rel=1e-6)
    assert fit["max_abs_fit_error_ge_1MB"] < 1e-6
    assert [r["regime"] for r in rows] == ["small"] * 5 + ["large"] * 4
    assert all(abs(r["fit_error"]) < 1e-6 for r in rows)


def test_few_sizes_fall_back_to_one_regime(bench_comm):
    rows = _rows(lambda g: 1e-4 + g * 1e-9, sizes=(1024, 4096, 16384))
    fit = bench_comm.fit_two_regimes(rows, 2)
    assert fit["regimes"] == 1 and fit["split_bytes"] is None and fit["max_abs_fit_error_ge_1MB"] is None
    assert {r["regime"] for r in rows} == {"small"}

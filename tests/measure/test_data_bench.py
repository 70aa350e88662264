"""The loader benchmark runs end to end at a tiny size and writes its JSON (no timing assertions)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loader.py"


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_bench_loader_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_loader", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "loader.json"
    result = bench.run(
        {
            "out": str(out),
            "episodes": 8,
            "max_steps": 40,
            "episodes_per_shard": 4,
            "batches": 20,
            "repeats": 1,
            "demand": 1000.0,
        }
    )
    assert set(result["compressors"]) == {"none", "zstd"}
    for c in result["compressors"].values():
        assert c["loader_windows_per_s"] > 0 and c["mmap_windows_per_s"] > 0
        assert c["loader_vs_demand"] == pytest.approx(c["loader_windows_per_s"] / 1000.0)
    assert json.loads(out.read_text())["benchmark"] == "loader"
    assert bench.training_demand_windows_per_s(batch=2, window=4, steps=2) > 0

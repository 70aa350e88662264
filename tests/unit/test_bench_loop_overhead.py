"""The run-level checkpoint overheads of benchmarks/bench_loop.py, computed from recorded rounds and clocks."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loop.py"


@pytest.fixture(scope="module")
def bench_loop():
    spec = importlib.util.spec_from_file_location("bench_loop", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _contender(round_means, checkpoint_s=None, wall_s=10.0):
    entry = {"mean_ms": sorted(round_means)[len(round_means) // 2], "round_means_ms": round_means}
    if checkpoint_s is not None:
        entry["wall_split"] = {"parts_s": {"compute": wall_s - checkpoint_s, "checkpoint": checkpoint_s},
                               "wall_s": wall_s}
    return entry


def test_overheads_pair_each_round_and_read_the_trainers_clock(bench_loop, capsys):
    # The load doubles between rounds: each round's pair costs 2% (sync) and 1% (async) however loaded it was.
    without = [10.0, 20.0, 40.0]
    report = {"contenders": {
        bench_loop.WITHOUT_CHECKPOINTS: _contender(without, checkpoint_s=0.1),  # its final save
        bench_loop.WITH_CHECKPOINTS: _contender([1.02 * t for t in without], checkpoint_s=0.3),
        bench_loop.WITH_ASYNC_CHECKPOINTS: _contender([1.01 * t for t in without], checkpoint_s=0.15),
    }}
    bench_loop.run_level_overheads(report, 250)
    assert report["run_level_checkpoint_overhead_paired"] == pytest.approx(0.02)
    assert report["run_level_async_checkpoint_overhead_paired"] == pytest.approx(0.01)
    assert report["run_level_checkpoint_overhead"] == pytest.approx(0.02)
    assert report["contenders"][bench_loop.WITH_CHECKPOINTS]["checkpoint_share_of_wall"] == pytest.approx(0.02)
    assert report["contenders"][bench_loop.WITH_ASYNC_CHECKPOINTS]["checkpoint_share_of_wall"] == pytest.approx(0.005)
    assert report["checkpoint_every"] == 250 and report["target_run_level_overhead"] == 0.035
    assert "paired by round +2.00%" in capsys.readouterr().out


def test_a_round_under_a_load_spike_does_not_move_the_paired_overhead(bench_loop):
    # Round 2's run with checkpoints met a spike the run without them did not: the paired median ignores it.
    overhead = bench_loop.paired_overhead([10.3, 20.6, 90.0], [10.0, 20.0, 30.0])
    assert overhead == pytest.approx(0.03)


def test_start_up_is_reported_apart_from_the_steady_state(bench_loop, tmp_path):
    """A slow start (the first steps share the process with MLflow's run start) shows in start-up and in the mean
    over the run, not in the steady state: the second half of the timed steps."""
    launched, first_end = 100.0, 103.5
    gaps = [0.010] * 10 + [0.004] * 20 + [0.5]  # slow early steps, settled ones, the final checkpoint
    ends = np.cumsum([first_end, *gaps])
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"event": "step_end", "t": float(t)}) + "\n" for t in ends))
    sample = bench_loop.read_trace(trace, launched)
    assert sample.startup_s == pytest.approx(3.5)
    assert len(sample.times) == 30  # the final checkpoint's gap is left out
    assert sample.steady.mean() == pytest.approx(0.004)
    assert sample.times.mean() == pytest.approx((10 * 0.010 + 20 * 0.004) / 30)

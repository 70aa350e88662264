"""`worldpipe bench checkpoint` and `worldpipe bench loader` through the CLI at tiny sizes.

Structure of the JSON only: benchmarks measure speed, tests never assert on it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ADDED = {"ours_async_added", "ours_async_added_normal_priority"}  # differences of timelines: may be <= 0
CHECKPOINT_WRITERS = {"raw", "direct_1", "direct_N", "ours_sync", "torch_save", "dcp", "ours_async",
                      "ours_async_overlap", *ADDED}
CHECKPOINT_STALLS = {"ours_async", "ours_async_overlap", *ADDED}
CHECKPOINT_LOADERS = {"load_sha256", "load_size", "torch_load"}
LOADER_FIELDS = {"build_s", "loader_first_batch_s", "loader_vs_demand", "loader_vs_mmap", "loader_windows_per_s",
                 "mmap_windows_per_s", "store_bytes", "training_loop_overhead"}


def bench(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["worldpipe", "bench", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def _positive_numbers(mapping: dict, keys: set[str]) -> None:
    assert set(mapping) == keys
    for key, value in mapping.items():
        assert isinstance(value, int | float) and value > 0, (key, value)


@pytest.mark.slow  # 21 s on a quiet 2-core machine: the default tier's 5-minute budget
def test_bench_checkpoint_writes_its_json(tmp_path, env_with_venv):
    out, work = tmp_path / "bench" / "checkpoint.json", tmp_path / "scratch"
    proc = bench(env_with_venv, tmp_path, "checkpoint", "--mb", "1", "--repeat", "2", "--step-s", "0.05",
                 "--dir", str(work), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["repeat"] == 2 and 0.5 < result["state_mb"] < 2
    # The whole added time is a difference of two timelines: it can come out <= 0 on a quiet machine.
    _positive_numbers({k: v for k, v in result["median_s"].items() if k not in ADDED},
                      (CHECKPOINT_WRITERS | CHECKPOINT_LOADERS) - ADDED)
    assert all(isinstance(result["median_s"][name], float) for name in ADDED)
    assert {k: len(v) for k, v in result["all_s"].items()} == dict.fromkeys(CHECKPOINT_WRITERS | CHECKPOINT_LOADERS, 2)
    _positive_numbers(result["bandwidth_MBps"], CHECKPOINT_WRITERS - CHECKPOINT_STALLS)
    _positive_numbers(result["ratio_vs_raw"], {"ours_sync", "torch_save", "dcp"})
    _positive_numbers(result["load_ratio_vs_torch_load"], {"load_sha256", "load_size"})
    for key in ("async_stall_over_sync", "async_overlap_stall_over_sync", "async_first_save_stall_s",
                "async_first_stall_over_sync"):
        assert result[key] > 0
    # Ratios are computed from the medians recorded beside them, not measured separately.
    med = result["median_s"]
    assert result["ratio_vs_raw"]["ours_sync"] == pytest.approx(med["raw"] / med["ours_sync"])
    assert result["async_stall_over_sync"] == pytest.approx(med["ours_async"] / med["ours_sync"])
    assert result["async_overlap_stall_over_sync"] == pytest.approx(med["ours_async_overlap"] / med["ours_sync"])
    # Whole cost of an async save: one entry per measured round, at least one overlapped step each.
    # Before and after lowering the writer's priority, measured in the same rounds.
    assert result["async_added_over_sync"] == pytest.approx(med["ours_async_added"] / med["ours_sync"])
    assert result["async_added_normal_priority_over_sync"] == pytest.approx(
        med["ours_async_added_normal_priority"] / med["ours_sync"])
    for name in ADDED:
        overlapped = result["async_added"][name]["steps_overlapped"]
        assert len(overlapped) == 2 and min(overlapped) >= 1
    # The device limit (O_DIRECT, one and N writers) and every writer as a fraction of it.
    limit = result["device_limit"]
    assert limit["limit_s"] == min(med["direct_1"], med["direct_N"]) and limit["writers"]["direct_1"] == 1
    for name, fraction in result["fraction_of_device_limit"].items():
        assert fraction == pytest.approx(limit["limit_s"] / med[name])
    assert "x raw" in proc.stdout and "async stall" in proc.stdout and "whole added time" in proc.stdout
    assert list(work.iterdir()) == []  # its checkpoints are cleaned up
    # The plot beside the JSON, both published by rename: no temporary file is left beside them.
    assert sorted(p.name for p in out.parent.iterdir()) == ["checkpoint.json", "checkpoint.png"]
    assert result["plot"] == str(out.with_suffix(".png"))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # builds two stores and times a GRU loop: ~25 s of CPU even at this size
def test_bench_loader_writes_its_json(tmp_path, env_with_venv):
    out = tmp_path / "bench" / "loader.json"
    proc = bench(env_with_venv, tmp_path, "loader", "--out", str(out), "--episodes", "8", "--max-steps", "24",
                 "--episodes-per-shard", "4", "--window", "8", "--batch", "4", "--batches", "4", "--repeats", "1",
                 "--demand", "1000", "--pixel-size", "16", "--pixel-episodes", "2", "--pixel-demand", "500")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "loader"
    assert result["config"] == {"batch": 4, "batches": 4, "demand": 1000.0, "episodes": 8, "episodes_per_shard": 4,
                                "max_steps": 24, "repeats": 1, "window": 8, "pixel_size": 16, "pixel_episodes": 2,
                                "pixel_demand": 500.0}
    pixels = result["pixels"]  # pixel windows: frames/s against the frames/s a PixelRSSM step consumes
    assert set(pixels) == {"pixel_size", "build_s", "store_bytes", "loader_frames_per_s", "loader_first_batch_s",
                           "training_demand_frames_per_s", "loader_vs_demand"}
    assert pixels["loader_vs_demand"] == pytest.approx(pixels["loader_frames_per_s"] / 500.0)
    assert set(result["compressors"]) == {"none", "zstd"}
    for fields in result["compressors"].values():
        assert set(fields) == LOADER_FIELDS
        assert fields["loader_vs_mmap"] == pytest.approx(fields["loader_windows_per_s"] / fields["mmap_windows_per_s"])
        assert fields["loader_vs_demand"] == pytest.approx(fields["loader_windows_per_s"] / 1000.0)
    assert set(result["targets"]) == {"loader_vs_demand", "loader_vs_mmap"}
    assert isinstance(result["meets_targets"], bool)
    assert result["training_demand_windows_per_s"] == 1000.0
    assert f"wrote {out}" in proc.stdout


@pytest.mark.parametrize(("name", "args"), [("comm", ["--nproc", "1"]), ("loop", ["--steps", "many"])])
def test_a_bad_option_is_one_line_naming_the_command(tmp_path, env_with_venv, name, args):
    proc = bench(env_with_venv, tmp_path, name, *args)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: worldpipe bench {name}: "), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_bench_step_reports_flops_peak_and_the_per_step_baseline(tmp_path, env_with_venv):
    out = tmp_path / "bench" / "step.json"
    proc = bench(env_with_venv, tmp_path, "step", "--experiment", "smoke", "--rounds", "2", "--steps", "2",
                 "--mm-sizes", "64,128", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["contenders"]) == {"per-step RSSM", "python-loop core", "model"}
    assert result["batch"] == 8 and result["window"] == 16
    assert len(result["peak_round_gflops"]) == 2 and result["peak_gflops"] > 0
    for c in result["contenders"].values():
        assert c["flops"] > 0 and len(c["round_step_ms"]) == 2
        # The fraction is computed from the numbers beside it, against the same run's peak.
        assert c["fraction_of_peak"] == pytest.approx(c["flops"] / (c["step_ms"] / 1e3) / 1e9 / result["peak_gflops"])
        assert c["best_step_ms"] <= c["step_ms"] and c["fraction_of_peak_best"] >= c["fraction_of_peak"]
        # By the thread's CPU time too, against the peak by CPU time (what other processes take does not enter).
        assert c["fraction_of_peak_cpu"] == pytest.approx(
            c["flops"] / (c["cpu_step_ms"] / 1e3) / 1e9 / result["peak_gflops_cpu"])
    # Same model, same FLOPs (up to the split first layers): the baseline differs only in how it loops.
    per_step, model = result["contenders"]["per-step RSSM"], result["contenders"]["model"]
    assert model["flops"] == pytest.approx(per_step["flops"], rel=0.02)
    # The compiled core's per-step products are BLAS calls the counter cannot see: the model's FLOPs are those of
    # the Python loops, which make the same products.
    assert model["flops_counted_on"] == "python-loop core"
    assert result["contenders"]["python-loop core"]["flops"] == model["flops"]
    assert result["speedup_vs_python_core"] == pytest.approx(
        result["contenders"]["python-loop core"]["step_ms"] / model["step_ms"])
    assert result["fraction_of_peak"] == model["fraction_of_peak"] and isinstance(result["meets_target"], bool)
    assert result["machine"]["load_average_before"] and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # The matmul floor replays exactly the step's matmuls: their FLOPs are the step's, and alone they are faster.
    floor = result["matmul_floor"]
    assert sum(_matmul_flops(s) * s["calls"] for s in floor["shapes"]) == model["flops"]
    assert floor["fraction_of_peak"] > model["fraction_of_peak"] and 0 < floor["share_of_step"] < 1
    # The model's own operator calls: its matmuls through the dispatcher are fewer than the floor's (the compiled
    # core's per-step products are not operator calls).
    by_name = floor["operator_calls_by_name"]
    assert floor["operator_calls"] == sum(by_name.values()) > by_name["mm"] + by_name.get("addmm", 0)
    assert 0 < by_name["mm"] + by_name.get("addmm", 0) < floor["calls"]


def _matmul_flops(call: dict) -> int:
    """2·m·k·n (times the batch of a bmm) of one recorded matmul from its operand shapes."""
    *_, left, right = call["shapes"]  # addmm/baddbmm: the bias comes first
    batch = left[0] if len(left) == 3 else 1
    return 2 * batch * left[-2] * left[-1] * right[-1]


@pytest.mark.slow  # two worker processes per round, each importing torch
def test_bench_numerics_times_both_modes_in_their_own_processes(tmp_path, env_with_venv):
    out = tmp_path / "bench" / "numerics.json"
    proc = bench(env_with_venv, tmp_path, "numerics", "--experiment", "smoke", "--rounds", "1", "--steps", "2",
                 "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["baseline"] == "native" and set(result["contenders"]) == {"native", "portable"}
    portable, native = (result["contenders"][m]["environment"] for m in ("portable", "native"))
    assert (portable["mkl.cbwr"], portable["aten.cpu_capability"]) == ("COMPATIBLE", "AVX2")
    assert native["mkl.cbwr"] != "COMPATIBLE" or "MKL_CBWR" in env_with_venv
    assert result["ratio"] == pytest.approx(result["contenders"]["portable"]["step_ms"]
                                            / result["contenders"]["native"]["step_ms"])
    assert Path(result["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

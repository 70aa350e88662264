"""`worldpipe bench comm` runs on real ranks and its exact quantities agree with their models."""

import json
import subprocess

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_comm_writes_json_and_plots(tmp_path, env_with_venv):
    out = tmp_path / "bench" / "comm.json"
    proc = subprocess.run(["worldpipe", "bench", "comm", "--max-mb", "1", "--repeat", "1", "--out", str(out)],
                          env=env_with_venv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["bytes"] for r in result["all_reduce"]] == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert all("fit_error" in r for r in result["all_reduce"])
    # Counted bytes are what the ring sends: exactly the model (N-1)·S·d_kv/N on every rank.
    assert all(r["bytes_sent"] == r["model_bytes"] for r in result["ring_attention"])
    # Parameters, gradients and Adam state per rank follow the ZeRO formulas (FSDP2 pads uneven shards: 5%).
    for layout, ratios in result["memory"]["measured_over_formula"].items():
        for category, ratio in ratios.items():
            assert abs(ratio - 1) <= 0.05, (layout, category, ratio)
    assert result["memory"]["measured"]["fsdp2"]["parameters"] < result["memory"]["measured"]["ddp"]["parameters"]
    bubble = result["pipeline_bubble"]
    assert [r["idle_model"] for r in bubble] == sorted((r["idle_model"] for r in bubble), reverse=True)
    for name in ("comm_allreduce.png", "comm_ring_bytes.png", "comm_bubble.png", "comm_memory.png"):
        assert (out.parent / name).stat().st_size > 0
